//! `/org/rdmad1/qp/<n>`, interface `org.rdmad1.QueuePair`. Only the connection that owns
//! the session may use it.

use std::collections::HashMap;
use std::net::{Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use rdmad_client::names::{qp_path, session_path};
use rdmad_client::types::{Endpoint, QueuePairInfo};
use rdmad_client::Error;
use zbus::message::Header;
use zbus::object_server::ObjectServer;
use zbus::zvariant::OwnedValue;
use zbus::{interface, Connection};

use super::addressing;
use super::context::Context;
use super::options::Options;
use super::wire;
use crate::engine::{LocalChoice, QpId, QpInfo, QpState, RemoteEndpoint};

pub struct QueuePairObject {
    ctx: Arc<Context>,
    id: QpId,
}

impl QueuePairObject {
    pub fn new(ctx: Arc<Context>, id: QpId) -> QueuePairObject {
        QueuePairObject { ctx, id }
    }
}

pub fn state_name(state: QpState) -> &'static str {
    match state {
        QpState::Reset => "reset",
        QpState::Init => "init",
        QpState::Rtr => "rtr",
        QpState::Rts => "rts",
        QpState::Sqd => "sqd",
        QpState::Sqe => "sqe",
        QpState::Error => "error",
    }
}

pub fn info(q: &QpInfo) -> QueuePairInfo {
    QueuePairInfo {
        id: q.id.0,
        path: wire::path(qp_path(q.id.0)),
        session: wire::path(session_path(q.session.0)),
        owner_uid: q.owner_uid,
        device: q.device.clone(),
        state: state_name(q.state).to_owned(),
        qp_num: q.qp_num,
        send_depth: q.send_depth,
        recv_depth: q.recv_depth,
        peer: match (q.peer, q.peer_address) {
            (Some((gid, qp_num)), Some(addr)) => format!("{addr} {gid}/{qp_num}"),
            (Some((gid, qp_num)), None) => format!("{gid}/{qp_num}"),
            _ => String::new(),
        },
        posted: q.posted,
        completed: q.completed,
        failed: q.failed,
        refused: q.refused,
    }
}

fn remote_endpoint(e: &Endpoint) -> Result<RemoteEndpoint, Error> {
    let gid: Ipv6Addr = e.gid.parse().map_err(|_| {
        Error::InvalidArgument(format!(
            "Connect: gid {:?} is not a GID in IPv6 notation (e.g. ::ffff:10.0.2.15)",
            e.gid
        ))
    })?;
    if gid.is_unspecified() {
        return Err(Error::InvalidArgument(
            "Connect: gid :: is not a peer's GID".into(),
        ));
    }
    if ![256, 512, 1024, 2048, 4096].contains(&e.mtu) {
        return Err(Error::InvalidArgument(format!(
            "Connect: mtu {} is not an RDMA path MTU (256, 512, 1024, 2048 or 4096)",
            e.mtu
        )));
    }
    Ok(RemoteEndpoint {
        gid,
        qp_num: e.qp_num,
        psn: e.psn,
        lid: e.lid,
    })
}

#[interface(name = "org.rdmad1.QueuePair")]
impl QueuePairObject {
    /// What a peer needs to connect to this queue pair.
    async fn endpoint(
        &self,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] connection: &Connection,
    ) -> Result<Endpoint, Error> {
        let caller = self.ctx.caller(connection, &header).await?;
        let local = self.ctx.engine.qp_endpoint(&caller.owner(), self.id)?;
        Ok(Endpoint {
            gid: local.gid.to_string(),
            gid_index: local.gid_index,
            qp_num: local.qp_num,
            psn: local.psn,
            mtu: local.mtu,
            lid: local.lid,
        })
    }

    /// Connects to a peer's endpoint (RESET → RTS), with timeouts, retries and atomic
    /// depth taken from the device. The path MTU is the smaller of the two ends'.
    async fn connect(
        &self,
        remote: Endpoint,
        options: HashMap<String, OwnedValue>,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] connection: &Connection,
    ) -> Result<(), Error> {
        let opts = Options::new("Connect", &options, &["psn", "gid_index", "state"])?;
        let caller = self.ctx.caller(connection, &header).await?;
        // Someone else's queue pair is refused before its arguments are looked at.
        self.ctx.engine.qp_endpoint(&caller.owner(), self.id)?;
        let peer = remote_endpoint(&remote)?;
        let narrow = |key: &str, v: Option<u64>| {
            v.map(|n| {
                u32::try_from(n).map_err(|_| {
                    Error::InvalidArgument(format!("Connect: option {key:?} is out of range: {n}"))
                })
            })
            .transpose()
        };
        let receive_only = match opts.string("state")?.as_deref() {
            None | Some("rts") => false,
            Some("rtr") => true,
            Some(other) => {
                return Err(Error::InvalidArgument(format!(
                    "Connect: option \"state\" is \"rts\" (the default) or \"rtr\", not {other:?}"
                )))
            }
        };
        let local = LocalChoice {
            psn: narrow("psn", opts.unsigned("psn")?)?,
            gid_index: narrow("gid_index", opts.unsigned("gid_index")?)?,
            receive_only,
        };
        let (id, peer_mtu) = (self.id, remote.mtu);
        self.ctx
            .blocking(move |e| e.connect_qp(&caller.owner(), id, peer, peer_mtu, local))
            .await??;
        tracing::info!(qp = %self.id, peer = %remote.gid, peer_qpn = remote.qp_num, "queue pair connected");
        Ok(())
    }

    /// Connects to whoever listens on `address` and `port` through rdma_cm (a plain
    /// rdma_cm program on another host, or another rdmad's `Listen`): resolves the address
    /// and route, sends a connection request, and on the peer's accept moves the queue
    /// pair (still in RESET) to RTS with the path rdma_cm chose. Options: `private_data`
    /// (`ay`, at most 56 bytes) for the request; `source` (`s`): the local address to
    /// connect from; `timeout_ms` (`u`, default 10000). Returns the connection: `address`,
    /// `port`, `local_address`, `local_port`, the peer's `qp_num` and the `private_data`
    /// of its accept. Fails with `ConnectionFailed` saying why (rejected with the peer's
    /// reason and words, nothing listening, unreachable, no answer). Destroying the queue
    /// pair disconnects; a disconnect by the peer moves it to the error state.
    async fn connect_to(
        &self,
        address: &str,
        port: u16,
        options: HashMap<String, OwnedValue>,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] connection: &Connection,
    ) -> Result<HashMap<String, OwnedValue>, Error> {
        let opts = Options::new(
            "ConnectTo",
            &options,
            &["private_data", "source", "timeout_ms"],
        )?;
        let private_data = opts.bytes("private_data")?.unwrap_or_default();
        let wait = addressing::timeout("ConnectTo", &opts, Duration::from_secs(10))?;
        let ip = addressing::ip("ConnectTo", "address", address)?.ok_or_else(|| {
            Error::InvalidArgument("ConnectTo: name the address to connect to".into())
        })?;
        if port == 0 {
            return Err(Error::InvalidArgument(
                "ConnectTo: port 0: name the port the peer listens on".into(),
            ));
        }
        let source = match opts.string("source")? {
            Some(text) => {
                addressing::ip("ConnectTo", "source", &text)?.map(|ip| SocketAddr::new(ip, 0))
            }
            None => None,
        };
        let caller = self.ctx.caller(connection, &header).await?;
        // Someone else's queue pair is refused before anything is sent.
        self.ctx.engine.qp_endpoint(&caller.owner(), self.id)?;
        let turn = self.ctx.connecting.take(caller.uid).await?;
        let id = self.id;
        let to = SocketAddr::new(ip, port);
        let connected = self
            .ctx
            .blocking(move |e| e.connect_to(&caller.owner(), id, to, source, private_data, wait))
            .await??;
        drop(turn);
        tracing::info!(qp = %self.id, peer = %to, peer_qpn = connected.peer_qp_num, "queue pair connected by address");
        addressing::describe(&connected)
    }

    /// Moves a queue pair connected with `{"state": "rtr"}` to RTS: option `psn` (`u`), the
    /// PSN its sends start from.
    async fn ready(
        &self,
        options: HashMap<String, OwnedValue>,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] connection: &Connection,
    ) -> Result<(), Error> {
        let opts = Options::new("Ready", &options, &["psn"])?;
        let psn = opts
            .unsigned("psn")?
            .map(|n| {
                u32::try_from(n).map_err(|_| {
                    Error::InvalidArgument(format!("Ready: option \"psn\" is out of range: {n}"))
                })
            })
            .transpose()?;
        let caller = self.ctx.caller(connection, &header).await?;
        let id = self.id;
        self.ctx
            .blocking(move |e| e.ready_qp(&caller.owner(), id, psn))
            .await??;
        tracing::info!(qp = %self.id, "queue pair ready to send");
        Ok(())
    }

    /// Moves the queue pair to the error state (verbs' `IBV_QPS_ERR`), from any state:
    /// every request it still holds completes with `WrFlushError`, as do any posted later.
    async fn flush(
        &self,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] connection: &Connection,
    ) -> Result<(), Error> {
        let caller = self.ctx.caller(connection, &header).await?;
        let id = self.id;
        self.ctx
            .blocking(move |e| e.flush_qp(&caller.owner(), id))
            .await??;
        tracing::info!(qp = %self.id, "queue pair moved to the error state");
        Ok(())
    }

    /// Destroys the queue pair (its windows first).
    async fn destroy(
        &self,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] connection: &Connection,
        #[zbus(object_server)] server: &ObjectServer,
    ) -> Result<(), Error> {
        let caller = self.ctx.caller(connection, &header).await?;
        let id = self.id;
        let removed = self
            .ctx
            .blocking(move |e| e.destroy_qp(&caller.owner(), id))
            .await??;
        self.ctx.withdraw(server, &removed).await;
        Ok(())
    }

    async fn get_info(
        &self,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] connection: &Connection,
    ) -> Result<QueuePairInfo, Error> {
        let caller = self.ctx.caller(connection, &header).await?;
        let id = self.id;
        // The state comes from the device (ibv_query_qp).
        let q = self
            .ctx
            .blocking(move |e| e.qp(&caller.owner(), id))
            .await??;
        Ok(info(&q))
    }
}
