//! Queue pairs — created, connected (path MTU and connect defaults chosen here), destroyed
//! — and the exports bound through them.

use super::snapshots::qp_info;
use super::*;

/// What a peer may do through an export.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RemoteRights {
    pub read: bool,
    pub write: bool,
    pub atomic: bool,
}

impl RemoteRights {
    fn access(self) -> crate::provider::Access {
        use crate::provider::Access;
        let mut access = Access::NONE;
        for (wanted, right) in [
            (self.read, Access::REMOTE_READ),
            (self.write, Access::REMOTE_WRITE),
            (self.atomic, Access::REMOTE_ATOMIC),
        ] {
            if wanted {
                access = access.union(right);
            }
        }
        access
    }
}

/// A new export: its id and what the peer needs to reach the region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExportHandout {
    pub export: ExportId,
    pub addr: u64,
    pub rkey: u32,
    pub len: u64,
}

#[cfg(test)]
impl ExportHandout {
    /// (export, addr, rkey, len).
    pub(super) fn parts(self) -> (ExportId, u64, u32, u64) {
        (self.export, self.addr, self.rkey, self.len)
    }
}

/// A new queue pair handed to its client: its id, descriptors of its ring memfd, its
/// doorbell (write end) and completion channel (read end), the ring's size and depths.
#[derive(Debug)]
pub struct QpHandout {
    pub id: QpId,
    pub qp_num: u32,
    pub ring: std::os::fd::OwnedFd,
    pub doorbell: std::os::fd::OwnedFd,
    pub completion: std::os::fd::OwnedFd,
    pub ring_size: u64,
    pub sq_entries: u32,
    pub cq_entries: u32,
}

impl Engine {
    /// The data-path worker serving `q`.
    fn worker_of(&self, q: &QueuePairRecord) -> Option<&datapath::worker::Worker> {
        q.worker.get().and_then(|&i| self.workers.get(i))
    }

    /// Creates a queue pair for `session` (`owner`'s) on `device`, within `limits`, and
    /// starts serving its rings.
    pub fn create_qp(
        &self,
        owner: &Owner,
        limits: &Limits,
        session: SessionId,
        device: &str,
        options: QpOptions,
    ) -> Result<QpHandout, EngineError> {
        let entry = self.device(device)?;
        let (id, record) = self
            .registry
            .create_qp(owner, limits, session, entry, options)?;
        // The worker serving the fewest QPs takes it.
        if let Some((index, worker)) = self
            .workers
            .iter()
            .enumerate()
            .min_by_key(|(_, w)| w.load())
        {
            let _ = record.worker.set(index);
            worker.add(id, Arc::clone(&record));
            // The session may have been closed since the registry took the QP, and the
            // worker told to let go of it before it had it: look again now that it has it.
            if self.registry.own_qp(owner, id).is_err() {
                worker.remove(&[id]);
                return Err(EngineError::NoSuchObject(format!(
                    "session {session} (closed while the queue pair was made)"
                )));
            }
        }
        let dup = |fd: std::os::fd::BorrowedFd<'_>| {
            fd.try_clone_to_owned()
                .map_err(|e| EngineError::os(format!("cannot hand out queue pair {id}"), e))
        };
        let handout = (|| {
            Ok(QpHandout {
                id,
                qp_num: record.local.qp_num,
                ring: dup(record.ring.fd())?,
                doorbell: dup(record.doorbell.client_end())?,
                completion: dup(record.completion_event.client_end())?,
                ring_size: record.ring.len() as u64,
                sq_entries: record.layout.sq_entries,
                cq_entries: record.layout.cq_entries,
            })
        })();
        if handout.is_err() {
            if let Ok(teardown) = self.registry.destroy_qp(owner, id) {
                self.release(teardown);
            }
        }
        handout
    }

    /// Whether `owner`'s connection owns queue pair `id`.
    pub fn owns_qp(&self, owner: &Owner, id: QpId) -> bool {
        self.registry.own_qp(owner, id).is_ok()
    }

    /// What a peer needs to connect to queue pair `id` (`owner`'s connection's).
    pub fn qp_endpoint(&self, owner: &Owner, id: QpId) -> Result<LocalEndpoint, EngineError> {
        Ok(self.registry.own_qp(owner, id)?.local.clone())
    }

    /// Connects queue pair `id` (`owner`'s connection's) to `peer`, with the path MTU the
    /// smaller of both ends' and the device's connect defaults (verbs calls: may block).
    pub fn connect_qp(
        &self,
        owner: &Owner,
        id: QpId,
        peer: RemoteEndpoint,
        peer_mtu: u32,
        local: LocalChoice,
    ) -> Result<(), EngineError> {
        let q = self.registry.own_qp(owner, id)?;
        let mtu = q.local.mtu.min(peer_mtu);
        let entry = self.device(&q.device)?;
        if let Some(psn) = local.psn {
            if psn > 0x00ff_ffff {
                return Err(EngineError::InvalidArgument(format!(
                    "psn {psn} is not a 24-bit packet sequence number"
                )));
            }
        }
        if let Some(index) = local.gid_index {
            let populated = entry
                .device
                .gid_table(q.local.port)?
                .iter()
                .any(|g| g.index == index);
            if !populated {
                return Err(EngineError::InvalidArgument(format!(
                    "gid_index {index} is not a populated GID of port {} of {} \
                     (`rdmactl dev show {}` lists them)",
                    q.local.port, q.device, q.device
                )));
            }
        }
        q.connect_with_mtu(entry.device.as_ref(), peer, mtu, local)
    }

    /// Moves queue pair `id`, connected receive-only, to RTS.
    pub fn ready_qp(&self, owner: &Owner, id: QpId, psn: Option<u32>) -> Result<(), EngineError> {
        let q = self.registry.own_qp(owner, id)?;
        let entry = self.device(&q.device)?;
        q.ready(entry.device.as_ref(), psn)
    }

    /// Moves queue pair `id` (`owner`'s connection's) to the error state: what it holds
    /// completes with `WrFlushError`, and what is posted later too (verbs calls: may
    /// block). A queue pair never connected goes through INIT first: devices (rxe) refuse
    /// RESET → ERR, and a queue pair in RESET would refuse later requests instead of
    /// flushing them.
    pub fn flush_qp(&self, owner: &Owner, id: QpId) -> Result<(), EngineError> {
        let q = self.registry.own_qp(owner, id)?;
        if q.state() == QpState::Reset {
            q.qp.to_init(q.local.port, crate::provider::Access::NONE)?;
        }
        Ok(q.qp.to_error()?)
    }

    /// Destroys queue pair `id` (`owner`'s connection's), its windows first; returns what
    /// was removed.
    pub fn destroy_qp(&self, owner: &Owner, id: QpId) -> Result<Removed, EngineError> {
        let teardown = self.registry.destroy_qp(owner, id)?;
        Ok(self.release(teardown))
    }

    /// Queue pair `id` (`owner`'s connection's), its state read from the device (may
    /// block).
    pub fn qp(&self, owner: &Owner, id: QpId) -> Result<QpInfo, EngineError> {
        Ok(qp_info(id, self.registry.own_qp(owner, id)?.as_ref()))
    }

    /// The queue pairs `viewer` may see, their states read from the device (may block).
    pub fn qps(&self, viewer: &Owner, scope: Scope) -> Vec<QpInfo> {
        self.registry
            .qps(viewer, scope)
            .iter()
            .map(|(id, q)| qp_info(*id, q))
            .collect()
    }

    // Exports.

    /// Binds a type-2 window over region `region` through QP `qp` (both `owner`'s
    /// connection's, on one device, the QP connected) so the QP's peer can reach it with
    /// `rights`, within the `exports` limit of `limits`. Every call binds a window of its
    /// own, with its own rkey and export id.
    pub fn export_remote(
        &self,
        owner: &Owner,
        limits: &Limits,
        region: RegionId,
        qp_id: QpId,
        rights: RemoteRights,
    ) -> Result<ExportHandout, EngineError> {
        let access = rights.access();
        if access == crate::provider::Access::NONE {
            return Err(EngineError::InvalidArgument(
                "an export must grant the peer something: read, write or atomics".into(),
            ));
        }
        let q = self.registry.own_qp(owner, qp_id)?;
        if let Some((number, _)) = q.domain {
            return Err(EngineError::NotSupported(format!(
                "queue pair {qp_id} is in the session's domain {number}: its peers reach the \
                 session's memory through the rkeys of that domain's registrations \
                 (Region.Register), not through exports"
            )));
        }
        let (mr, device) = self.registry.own_region_mr(owner, region)?;
        if device != q.device {
            return Err(EngineError::InvalidArgument(format!(
                "region {region} is registered on {device}, queue pair {qp_id} is on {}",
                q.device
            )));
        }
        if q.state() != QpState::Rts {
            return Err(EngineError::InvalidArgument(format!(
                "queue pair {qp_id} is not connected: Connect it before exporting through it"
            )));
        }
        self.registry.reserve(limits, QuotaKind::Exports, 1)?;
        let bound = self
            .bind_window(owner, region, qp_id, &q, &mr, access)
            .and_then(|window| {
                let rkey = window.rkey();
                Ok((self.registry.add_export(region, qp_id, window)?, rkey))
            });
        match bound {
            Ok((export, rkey)) => Ok(ExportHandout {
                export,
                addr: mr.addr(),
                rkey,
                len: mr.len() as u64,
            }),
            Err(e) => {
                self.registry
                    .unreserve(limits.uid, &[(QuotaKind::Exports, 1)]);
                Err(e)
            }
        }
    }

    /// Allocates a type-2 window and binds it over `mr` through QP `qp_id` (the
    /// device's worker posts the bind).
    fn bind_window(
        &self,
        owner: &Owner,
        region: RegionId,
        qp_id: QpId,
        q: &QueuePairRecord,
        mr: &Arc<dyn crate::provider::MemoryRegion>,
        access: crate::provider::Access,
    ) -> Result<Arc<dyn crate::provider::MemoryWindow>, EngineError> {
        use crate::provider::{MwType, SendOp};
        let entry = self.device(&q.device)?;
        let window = entry.pd.alloc_mw(MwType::Type2)?;
        let worker = self.worker_of(q).ok_or_else(|| {
            EngineError::DeviceUnusable(format!("no data-path worker serves queue pair {qp_id}"))
        })?;
        worker
            .run(
                qp_id,
                SendOp::BindMw {
                    mw: Arc::clone(&window),
                    mr: Arc::clone(mr),
                    addr: mr.addr(),
                    len: mr.len() as u64,
                    access,
                },
            )
            .map_err(|e| {
                // Destroyed (or its session closed) meanwhile: that is what the caller hears.
                if self.registry.own_qp(owner, qp_id).is_err() {
                    EngineError::NoSuchObject(format!(
                        "queue pair {qp_id} (destroyed while the export was being made)"
                    ))
                } else {
                    EngineError::Worker {
                        what: format!("cannot bind a window over region {region}"),
                        source: e,
                    }
                }
            })?;
        Ok(window)
    }

    /// Invalidates and releases export `export` of region `region` (`owner`'s
    /// connection's): the peer's rkey stops working.
    pub fn release_export(
        &self,
        owner: &Owner,
        region: RegionId,
        export: ExportId,
    ) -> Result<(), EngineError> {
        let (qp_id, taken) = self.registry.remove_export(owner, region, export)?;
        let record = self.registry.own_qp(owner, qp_id);
        if let Some(worker) = record.ok().and_then(|q| self.worker_of(&q)) {
            let rkey = taken.window.rkey();
            if let Err(e) = worker.run(qp_id, crate::provider::SendOp::LocalInvalidate { rkey }) {
                // Dropping the window below invalidates it as well. A QP destroyed since it
                // was looked up (its session closed, `Destroy`) is no surprise.
                // Nor is one its client moved to the error state (`Flush`): the device
                // flushes what is posted there, and deallocating the window is the
                // invalidation.
                let flushed = matches!(
                    e,
                    super::datapath::worker::WorkerError::Completion(
                        crate::provider::WcStatus::WrFlushError
                    )
                );
                if flushed {
                    tracing::debug!(region = %region, export = %export, "the queue pair is in the error state: {e}");
                } else if self.registry.own_qp(owner, qp_id).is_ok() {
                    tracing::warn!(region = %region, export = %export, "invalidation failed: {e}");
                } else {
                    tracing::debug!(region = %region, export = %export, "the queue pair went away first: {e}");
                }
            }
        }
        // Deallocated whether or not the invalidation worked; the QP (which may have been
        // destroyed meanwhile) and the registration (the region may have been freed) go
        // only after the window.
        drop(taken);
        Ok(())
    }
}
