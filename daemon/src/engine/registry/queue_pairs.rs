//! Queue pairs and the exports bound through them.

use std::sync::Arc;

use super::*;

impl Registry {
    /// Creates a queue pair for `session` (`owner`'s) on `entry`'s device, within the `qps`
    /// limit of `limits`.
    pub fn create_qp(
        &self,
        owner: &Owner,
        limits: &Limits,
        session: SessionId,
        entry: &DeviceEntry,
        options: QpOptions,
    ) -> Result<(QpId, Arc<QueuePairRecord>), EngineError> {
        let rights = {
            let mut s = self.lock();
            let rights = Arc::clone(&Self::own_session(&mut s, owner, session)?.rights);
            let usage = s.usage.entry(owner.uid).or_default();
            tenancy::check(limits, usage, QuotaKind::Qps, 1)?;
            usage.add(QuotaKind::Qps, 1);
            rights
        };
        let unreserve = |registry: &Registry| registry.unreserve(owner.uid, &[(QuotaKind::Qps, 1)]);
        // In a domain of the session's own, or in the daemon's protection domain.
        let domain_key = options.domain.map(|n| (entry.device.name().to_owned(), n));
        let domain = match options.domain {
            Some(number) => match self.take_domain_use(owner, session, entry, number) {
                Ok((id, pd)) => Some((number, id, pd)),
                Err(e) => {
                    unreserve(self);
                    return Err(e);
                }
            },
            None => None,
        };
        let give_back = |registry: &Registry| {
            if let Some(key) = &domain_key {
                registry.give_back_domain_use(session, key);
            }
            unreserve(registry);
        };
        let record = match qp::create(entry, domain, session, owner.uid, options, rights) {
            Ok(r) => Arc::new(r),
            Err(e) => {
                give_back(self);
                return Err(e);
            }
        };
        let mut s = self.lock();
        if Self::own_session(&mut s, owner, session).is_err() {
            drop(s);
            give_back(self);
            return Err(EngineError::NoSuchObject(format!(
                "session {session} (closed while the queue pair was made)"
            )));
        }
        s.last_qp = s.last_qp.next();
        let id = s.last_qp;
        s.sessions
            .get_mut(&session)
            .expect("checked above")
            .qps
            .insert(id);
        s.qps.insert(id, Arc::clone(&record));
        Ok((id, record))
    }

    /// A queue pair, if `owner`'s connection owns it.
    pub fn own_qp(&self, owner: &Owner, id: QpId) -> Result<Arc<QueuePairRecord>, EngineError> {
        let s = self.lock();
        let record = s
            .qps
            .get(&id)
            .ok_or(EngineError::NoSuchObject(format!("queue pair {id}")))?;
        let holder = s
            .sessions
            .get(&record.session)
            .map(|x| x.owner.connection.as_str());
        if holder != Some(owner.connection.as_str()) {
            return Err(not_authorized(format!(
                "queue pair {id} belongs to another session; only its owner may use it"
            )));
        }
        Ok(Arc::clone(record))
    }

    /// Destroys a queue pair (its owner only); its windows go first.
    pub fn destroy_qp(&self, owner: &Owner, id: QpId) -> Result<Teardown<'_>, EngineError> {
        self.own_qp(owner, id)?;
        let mut s = self.lock();
        let Some(record) = s.qps.remove(&id) else {
            return Err(EngineError::NoSuchObject(format!("queue pair {id}")));
        };
        if let Some(session) = s.sessions.get_mut(&record.session) {
            session.qps.remove(&id);
        }
        let mut garbage = Garbage::default();
        garbage.take_windows_of(&mut s, id, &record);
        if let Some(usage) = s.usage.get_mut(&record.owner_uid) {
            usage.sub(QuotaKind::Qps, 1);
        }
        Self::forget_idle_user(&mut s, record.owner_uid);
        if let Some((number, _)) = record.domain {
            let key = (record.device.clone(), number);
            let pd = Self::drop_domain_use(&mut s, record.session, &key);
            garbage.domains.extend(pd);
        }
        garbage.qps.push(record);
        let removed = Removed {
            qps: vec![id],
            ..Removed::default()
        };
        Ok(self.teardown(s, removed, garbage))
    }

    /// Records a window bound over region `id` through `qp`, keeping the `exports` use
    /// reserved for it; returns the export id, or gives the window back if the region or
    /// QP went away meanwhile (the caller then gives the reservation back).
    pub fn add_export(
        &self,
        id: RegionId,
        qp: QpId,
        window: Arc<dyn crate::provider::MemoryWindow>,
    ) -> Result<ExportId, EngineError> {
        let mut s = self.lock();
        let record = s
            .qps
            .get(&qp)
            .cloned()
            .ok_or(EngineError::NoSuchObject(format!("queue pair {qp}")))?;
        s.last_export = s.last_export.next();
        let export = s.last_export;
        let region = s
            .regions
            .get_mut(&id)
            .ok_or(EngineError::NoSuchObject(format!("region {id}")))?;
        region.exports.insert((qp, export));
        let mr = Arc::clone(&region.mr);
        lock(&record.exports).insert(
            export,
            Export {
                region: id,
                window,
                mr,
            },
        );
        Ok(export)
    }

    /// Removes an export of a region `owner`'s connection owns; returns its QP's id and its window
    /// with what must outlive it (the caller invalidates the window, then drops it all: the
    /// QP may have been destroyed, and the region freed, meanwhile).
    pub fn remove_export(
        &self,
        owner: &Owner,
        id: RegionId,
        export: ExportId,
    ) -> Result<(QpId, TakenWindow), EngineError> {
        let mut s = self.lock();
        Self::own_region(&s, owner, id)?;
        let (qp, _) = *s.regions[&id]
            .exports
            .iter()
            .find(|(_, e)| *e == export)
            .ok_or(EngineError::NoSuchObject(format!(
                "export {export} of region {id}"
            )))?;
        let region = s.regions.get_mut(&id).expect("checked");
        region.exports.remove(&(qp, export));
        let uid = region.owner_uid;
        if let Some(usage) = s.usage.get_mut(&uid) {
            usage.sub(QuotaKind::Exports, 1);
        }
        Self::forget_idle_user(&mut s, uid);
        let taken = s
            .qps
            .get(&qp)
            .and_then(|r| {
                lock(&r.exports)
                    .remove(&export)
                    .map(|e| TakenWindow::new(e, r))
            })
            .ok_or(EngineError::NoSuchObject(format!(
                "export {export} (its queue pair is gone)"
            )))?;
        Ok((qp, taken))
    }
}
