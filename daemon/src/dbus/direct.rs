//! Direct connections: `Manager.OpenDirect` hands its caller one end of a socket pair, on
//! which rdmad serves the same objects peer to peer. A call on it goes straight to rdmad
//! instead of through `dbus-daemon` (two hops each way), so it costs about one bus round
//! trip less (docs/api.md, "Direct connections").
//!
//! The caller's identity is the one the bus vouched for when it called `OpenDirect`: the
//! channel is a socket pair rdmad made, never a socket anyone can connect to, so no
//! credentials need reading from it and none can be forged on it. Every call on the channel
//! runs as that caller. What is opened on a channel — sessions, and their regions and queue
//! pairs — belongs to the channel (its connection name is the bus name it was opened from
//! with `/direct` and a number appended) and is closed when the channel closes, as a bus
//! connection's sessions are when it leaves the bus.
//!
//! Each user may hold [`PER_USER`] channels at once, so idle channels cannot exhaust the
//! daemon's descriptors.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex};

use rdmad_client::Error;
use zbus::object_server::ObjectServer;
use zbus::Connection;

use super::context::Context;
use crate::lock::lock;
use crate::policy::Caller;

/// The most direct connections one user holds at once.
pub const PER_USER: usize = 64;

/// The open direct connections.
#[derive(Default)]
pub struct Channels {
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// Set when the daemon stops: no channel opens after that.
    closed: bool,
    next: u64,
    open: HashMap<String, Channel>,
}

struct Channel {
    uid: u32,
    /// The channel's connection, once it is served.
    connection: Option<Connection>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Channels {
    /// Whether the channel `name` (a caller's connection name) is open.
    pub fn is_open(&self, name: &str) -> bool {
        lock(&self.state).open.contains_key(name)
    }

    /// The object server of channel `name`, while it is open and served.
    pub fn server_of(&self, name: &str) -> Option<ObjectServer> {
        let state = lock(&self.state);
        let connection = state.open.get(name)?.connection.as_ref()?;
        Some(connection.object_server().clone())
    }

    /// Closes every channel and waits until none runs (the daemon is stopping).
    pub async fn close_all(&self) {
        let channels: Vec<Channel> = {
            let mut state = lock(&self.state);
            state.closed = true;
            state.open.drain().map(|(_, c)| c).collect()
        };
        for mut channel in channels {
            if let Some(task) = channel.task.take() {
                task.abort();
                let _ = task.await;
            }
            if let Some(connection) = channel.connection.take() {
                connection.graceful_shutdown().await;
            }
        }
    }

    fn remove(&self, name: &str) -> Option<Channel> {
        lock(&self.state).open.remove(name)
    }
}

/// Whether a caller's connection name is a direct connection's (a bus's unique names hold
/// no `/`).
pub fn is_direct(connection_name: &str) -> bool {
    connection_name.contains('/')
}

/// A GUID for a channel: 32 hex digits from the system's random source.
fn new_guid() -> Result<String, Error> {
    let mut bytes = [0u8; 16];
    getrandom::fill(&mut bytes)
        .map_err(|e| Error::DeviceError(format!("no random bytes for a connection GUID: {e}")))?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// Opens a direct connection for `caller` (who called on the bus) and returns the caller's
/// end of it.
pub fn open(ctx: &Arc<Context>, caller: &Caller) -> Result<OwnedFd, Error> {
    if is_direct(&caller.bus_name) {
        return Err(Error::InvalidArgument(
            "OpenDirect is called on the bus: this connection is a direct one already".into(),
        ));
    }
    let guid = new_guid()?;
    let (ours, theirs) = std::os::unix::net::UnixStream::pair()
        .map_err(|e| Error::DeviceError(format!("cannot make a socket pair: {e}")))?;
    let name = {
        let mut state = lock(&ctx.direct.state);
        if state.closed {
            return Err(Error::DeviceError("rdmad is stopping".into()));
        }
        let held = state.open.values().filter(|c| c.uid == caller.uid).count();
        if held >= PER_USER {
            return Err(Error::QuotaExceeded(format!(
                "user {} holds {held} direct connections, the most one user may hold: close \
                 one (drop its connection) before opening another",
                caller.uid
            )));
        }
        state.next += 1;
        let name = format!("{}/direct{}", caller.bus_name, state.next);
        state.open.insert(
            name.clone(),
            Channel {
                uid: caller.uid,
                connection: None,
                task: None,
            },
        );
        name
    };
    let channel_caller = Caller {
        bus_name: name.clone(),
        ..caller.clone()
    };
    ctx.callers.add_direct(&guid, channel_caller.clone());
    let served = ours
        .set_nonblocking(true)
        .and_then(|()| tokio::net::UnixStream::from_std(ours));
    let stream = match served {
        Ok(stream) => stream,
        Err(e) => {
            ctx.direct.remove(&name);
            ctx.callers.forget_direct(&guid);
            return Err(Error::DeviceError(format!(
                "cannot serve a direct connection: {e}"
            )));
        }
    };
    let task = tokio::spawn(run(Arc::clone(ctx), channel_caller, guid, stream));
    if let Some(channel) = lock(&ctx.direct.state).open.get_mut(&name) {
        channel.task = Some(task);
    }
    tracing::info!(
        uid = caller.uid,
        sender = %caller.bus_name,
        channel = %name,
        "direct connection opened"
    );
    Ok(OwnedFd::from(theirs))
}

/// Serves one channel until it closes, then closes what was opened on it.
async fn run(ctx: Arc<Context>, caller: Caller, guid: String, stream: tokio::net::UnixStream) {
    let name = caller.bus_name.clone();
    let built = async {
        let builder = zbus::connection::Builder::authenticated_socket(stream, guid.as_str())?.p2p();
        super::with_objects(builder, &ctx)?.build().await
    }
    .await;
    let connection = match built {
        Ok(connection) => connection,
        Err(e) => {
            let closed = matches!(&e, zbus::Error::InputOutput(io)
                if matches!(io.kind(), std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset));
            if closed {
                tracing::info!(channel = %name, "direct connection closed by its caller before it was served");
            } else {
                tracing::warn!(channel = %name, "cannot serve a direct connection: {e}");
            }
            ctx.direct.remove(&name);
            ctx.callers.forget_direct(&guid);
            return;
        }
    };
    let registered = match lock(&ctx.direct.state).open.get_mut(&name) {
        Some(channel) => {
            channel.connection = Some(connection.clone());
            true
        }
        None => false,
    };
    if registered {
        connection.closed().await;
    }
    let server = connection.object_server().clone();
    ctx.direct.remove(&name);
    ctx.callers.forget_direct(&guid);
    ctx.connection_gone(&server, &name).await;
    tracing::info!(channel = %name, "direct connection closed");
}
