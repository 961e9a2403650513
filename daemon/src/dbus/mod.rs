//! The D-Bus face of rdmad: one file per object type. The only place that knows zbus.
//! Arguments are parsed and validated here, the caller's identity comes from the bus, and
//! engine errors become `org.rdmad1.Error.*` replies in one place (`error.rs`).

mod addressing;
mod caller;
mod context;
mod device;
mod direct;
mod error;
mod manager;
mod options;
mod pool;
mod queue_pair;
mod region;
mod session;
mod turns;
mod wire;

use std::sync::Arc;

use rdmad_client::names::{BUS_NAME, MANAGER_PATH};
use zbus::fdo::{ObjectManager, RequestNameFlags, RequestNameReply};
use zbus::Connection;

pub use context::Context;
pub use device::DeviceObject;
pub use error::to_dbus_error;
pub use manager::{Manager, Reloader};

use crate::engine::Engine;

/// Which bus to serve on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Bus {
    System,
    Session,
    Address(String),
}

impl Bus {
    pub fn parse(s: &str) -> Bus {
        match s {
            "system" => Bus::System,
            "session" => Bus::Session,
            address => Bus::Address(address.to_owned()),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("cannot connect to the {bus} bus: {source}")]
    Connect { bus: String, source: zbus::Error },
    #[error("another process owns {BUS_NAME} on this bus (is rdmad already running?)")]
    NameTaken,
    #[error(
        "the bus refused to let this user own {BUS_NAME}: {0} (the bus policy, \
         /usr/share/dbus-1/system.d/org.rdmad1.conf, lets only root own it)"
    )]
    NameDenied(String),
    #[error("cannot serve the D-Bus objects: {0}")]
    Serve(#[from] zbus::Error),
}

/// Connects to `bus`, serves every object, and only then requests the bus name, so a
/// client that sees the name finds the objects.
/// The daemon on the bus: the connection, and the task that closes the sessions of
/// connections that leave.
pub struct Served {
    pub connection: Connection,
    watcher: Departures,
    ctx: Arc<Context>,
}

/// The task that handles departures from the bus, and how to tell it to stop.
struct Departures {
    task: tokio::task::JoinHandle<()>,
    stop: Arc<tokio::sync::Notify>,
}

/// How long stopping waits for the departures under way to be handled.
const DEPARTURES_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// Serves the objects every connection of rdmad's has — the manager (with its object
/// manager), the devices and the pools — on the connection `builder` makes: the bus
/// connection and every direct one.
fn with_objects<'a>(
    builder: zbus::connection::Builder<'a>,
    ctx: &Arc<Context>,
    life: Option<tokio::sync::watch::Sender<()>>,
) -> zbus::Result<zbus::connection::Builder<'a>> {
    let engine = &ctx.engine;
    let mut builder = builder
        .serve_at(MANAGER_PATH, ObjectManager)?
        .serve_at(MANAGER_PATH, Manager::new(Arc::clone(ctx), life))?;
    for name in engine.device_names() {
        let object = DeviceObject::new(Arc::clone(engine), name);
        builder = builder.serve_at(object.path(), object)?;
    }
    for name in engine.pool_names() {
        builder = builder.serve_at(
            rdmad_client::names::pool_path(&name),
            pool::PoolObject::new(Arc::clone(engine), name),
        )?;
    }
    Ok(builder)
}

pub async fn serve(
    bus: &Bus,
    engine: Arc<Engine>,
    reloader: Reloader,
) -> Result<Served, ServeError> {
    let builder = match bus {
        Bus::System => zbus::connection::Builder::system(),
        Bus::Session => zbus::connection::Builder::session(),
        Bus::Address(addr) => zbus::connection::Builder::address(addr.as_str()),
    };
    let connect_error = |source| ServeError::Connect {
        bus: match bus {
            Bus::System => "system".to_owned(),
            Bus::Session => "session".to_owned(),
            Bus::Address(a) => a.clone(),
        },
        source,
    };
    let ctx = Arc::new(Context {
        engine: Arc::clone(&engine),
        callers: caller::CallerCache::default(),
        reloader,
        connecting: turns::Turns::new(turns::CONNECTING_PER_USER),
        window_work: turns::Turns::new(turns::WINDOW_WORK_PER_USER),
        direct: direct::Channels::default(),
        grants: std::sync::Mutex::default(),
        bus: std::sync::Mutex::default(),
        served_direct: std::sync::Mutex::default(),
    });
    let builder = with_objects(builder.map_err(connect_error)?, &ctx, None)?;
    let connection = builder.build().await.map_err(connect_error)?;
    *crate::lock::lock(&ctx.bus) = Some(connection.object_server().clone());
    let watcher = watch_departures(&connection, Arc::clone(&ctx)).await?;

    match connection
        .request_name_with_flags(BUS_NAME, RequestNameFlags::DoNotQueue.into())
        .await
    {
        Ok(RequestNameReply::PrimaryOwner | RequestNameReply::AlreadyOwner) => Ok(Served {
            connection,
            watcher,
            ctx,
        }),
        Ok(RequestNameReply::Exists | RequestNameReply::InQueue) | Err(zbus::Error::NameTaken) => {
            Err(ServeError::NameTaken)
        }
        Err(zbus::Error::MethodError(name, msg, _))
            if name.as_str() == "org.freedesktop.DBus.Error.AccessDenied" =>
        {
            Err(ServeError::NameDenied(msg.unwrap_or_default()))
        }
        Err(zbus::Error::FDO(e)) if matches!(*e, zbus::fdo::Error::AccessDenied(_)) => {
            Err(ServeError::NameDenied(e.to_string()))
        }
        Err(e) => Err(e.into()),
    }
}

/// Closes the sessions of every connection that leaves the bus (exit, crash, SIGKILL): the
/// bus daemon announces it with `NameOwnerChanged(name, old, "")`. Each departure is
/// handled on its own task: one whose teardown is slow (a worker slow to let go of its
/// queue pairs, say) holds up neither other clients' departures nor the announcements,
/// which queue in the bus connection (and stop it reading the bus while the queue is full).
async fn watch_departures(
    connection: &Connection,
    ctx: Arc<Context>,
) -> Result<Departures, ServeError> {
    use futures_util::StreamExt;
    let dbus = zbus::fdo::DBusProxy::new(connection).await?;
    let mut changes = dbus.receive_name_owner_changed().await?;
    let server = connection.object_server().clone();
    let stop = Arc::new(tokio::sync::Notify::new());
    let stopped = Arc::clone(&stop);
    let task = tokio::spawn(async move {
        let mut departures = tokio::task::JoinSet::new();
        let handled = |done: Result<(), tokio::task::JoinError>| {
            if let Err(e) = done {
                tracing::error!("handling a departure from the bus failed: {e}");
            }
        };
        loop {
            tokio::select! {
                () = stopped.notified() => break,
                change = changes.next() => {
                    let Some(change) = change else { break };
                    let Ok(args) = change.args() else { continue };
                    if args.new_owner().is_none() && args.name().starts_with(':') {
                        let (ctx, server) = (Arc::clone(&ctx), server.clone());
                        let name = args.name().to_string();
                        departures.spawn(async move { ctx.connection_gone(&server, &name).await });
                    }
                }
                Some(done) = departures.join_next(), if !departures.is_empty() => handled(done),
            }
        }
        // Those under way finish (their sessions are out of the registry: their objects
        // must be withdrawn too), within a bound; what is left then is aborted.
        let _ = tokio::time::timeout(DEPARTURES_WAIT, async {
            while let Some(done) = departures.join_next().await {
                handled(done);
            }
        })
        .await;
    });
    Ok(Departures { task, stop })
}

/// Gives up the bus name, closes the direct connections, then withdraws every object so
/// the object server lets go of the engine before it is shut down.
pub async fn unserve(served: Served, engine: &Engine) {
    let Served {
        connection,
        watcher,
        ctx,
    } = served;
    watcher.stop.notify_one();
    // Wait until the task (and the engine reference it holds) is gone.
    let _ = watcher.task.await;
    // Direct connections: shut now; what was opened on them closes as they end.
    ctx.direct.shut_all();
    if let Err(e) = connection.release_name(BUS_NAME).await {
        tracing::warn!("cannot release the bus name: {e}");
    }
    let server = connection.object_server();
    let mut results = Vec::new();
    for name in engine.device_names() {
        let path = rdmad_client::device_path(&name);
        results.push(server.remove::<DeviceObject, _>(path).await);
    }
    for name in engine.pool_names() {
        let path = rdmad_client::names::pool_path(&name);
        results.push(server.remove::<pool::PoolObject, _>(path).await);
    }
    let removed = engine.close_all();
    // With every session closed no call on a direct connection waits any more (for a
    // connection by address, say): wait for them to end, then let go of what they served.
    ctx.direct.wait_all().await;
    crate::lock::lock(&ctx.served_direct).clear();
    crate::lock::lock(&ctx.bus).take();
    drop(ctx);
    // Regions and queue pairs made on direct connections were served there alone.
    for id in &removed.qps {
        let path = rdmad_client::names::qp_path(id.0);
        results.push(context::served(
            server.remove::<queue_pair::QueuePairObject, _>(path).await,
        ));
    }
    for id in &removed.regions {
        let path = rdmad_client::names::region_path(id.0);
        results.push(context::served(
            server.remove::<region::RegionObject, _>(path).await,
        ));
    }
    for id in &removed.sessions {
        results.push(
            server
                .remove::<session::SessionObject, _>(rdmad_client::names::session_path(id.0))
                .await,
        );
    }
    results.push(server.remove::<Manager, _>(MANAGER_PATH).await);
    for result in results {
        if let Err(e) = result {
            tracing::warn!("cannot withdraw a D-Bus object: {e}");
        }
    }
    connection.graceful_shutdown().await;
}
