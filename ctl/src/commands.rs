//! One function per `OBJECT COMMAND`.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::anyhow;
use rdmad_client::names::{object_id, session_path};
use rdmad_client::proxy::{DeviceProxy, ManagerProxy, SessionProxy};
use rdmad_client::{Error, BUS_NAME};
use serde_json::{json, Value};
use zbus::Connection;

use crate::cli::{Cli, DevCommand, KeyCommand, Object, SessionCommand};
use crate::output::Printer;

pub async fn run(cli: &Cli) -> anyhow::Result<()> {
    let printer = Printer {
        json: cli.json,
        pretty: cli.pretty,
    };
    let connection = rdmad_client::connect(Some(&cli.bus))
        .await
        .map_err(|e| anyhow!("cannot connect to the {} bus: {e}", cli.bus))?;
    let result = match &cli.object {
        Object::Status => status(&connection).await.map(|v| printer.print(&v)),
        Object::Exec { .. } => unreachable!("main runs exec before connecting"),
        Object::Dev { command } => {
            let name = match command {
                None | Some(DevCommand::Show { name: None }) => None,
                Some(DevCommand::Show { name: Some(n) }) => Some(n.as_str()),
            };
            devices(&connection, name).await.map(|v| printer.print(&v))
        }
        Object::Reload => reload(&connection).await,
        Object::Pool { .. } => pools(&connection).await.map(|v| printer.print(&v)),
        Object::Session { command } => match command {
            None | Some(SessionCommand::Show) => {
                sessions(&connection).await.map(|v| printer.print(&v))
            }
            Some(SessionCommand::Close { id }) => close_session(&connection, *id).await,
        },
        Object::Region { .. } => regions(&connection).await.map(|v| printer.print(&v)),
        Object::Qp { .. } => queue_pairs(&connection).await.map(|v| printer.print(&v)),
        Object::Quota { user } => match resolve_user(user.as_deref()) {
            Ok(uid) => quota(&connection, uid).await.map(|v| printer.print(&v)),
            Err(e) => return Err(e),
        },
        Object::Key { command } => match command {
            None | Some(KeyCommand::Show) => keys(&connection).await.map(|v| printer.print(&v)),
            Some(KeyCommand::Revoke { id }) => revoke_key(&connection, *id).await,
        },
    };
    result.map_err(|e| explain(e, &cli.bus))
}

/// Turns a failed call into one line a person can act on.
fn explain(e: Error, bus: &str) -> anyhow::Error {
    if e.is_daemon_absent() {
        return anyhow!("rdmad is not running (nothing owns {BUS_NAME} on the {bus} bus)");
    }
    match &e {
        Error::ZBus(zbus::Error::MethodError(name, Some(msg), _)) => anyhow!("{msg} ({name})"),
        // rdmad's own errors carry a message written for people.
        _ => anyhow!("{}", e.message()),
    }
}

async fn manager(connection: &Connection) -> Result<ManagerProxy<'static>, Error> {
    Ok(ManagerProxy::new(connection).await?)
}

async fn status(connection: &Connection) -> Result<Value, Error> {
    let m = manager(connection).await?;
    let started_us = m.start_timestamp().await?;
    let started = UNIX_EPOCH + Duration::from_micros(started_us);
    let uptime = SystemTime::now()
        .duration_since(started)
        .unwrap_or_default()
        .as_secs();
    let devices: Vec<String> = m
        .list_devices()
        .await?
        .into_iter()
        .map(|d| d.name)
        .collect();
    Ok(json!({
        "version": m.version().await?,
        "started_usec": started_us,
        "uptime_sec": uptime,
        "config_file": m.config_file().await?,
        "reloads": m.n_reloads().await?,
        "devices": devices,
    }))
}

async fn devices(connection: &Connection, name: Option<&str>) -> Result<Value, Error> {
    let m = manager(connection).await?;
    let paths = match name {
        Some(name) => vec![m.get_device(name).await?],
        None => m
            .list_devices()
            .await?
            .into_iter()
            .map(|d| d.path)
            .collect(),
    };
    let mut out = Vec::new();
    for path in paths {
        let d = DeviceProxy::builder(connection).path(path)?.build().await?;
        out.push(json!({
            "ifname": d.name().await?,
            "provider": d.provider().await?,
            "node_guid": d.node_guid().await?,
            "fw": d.firmware_version().await?,
            "port": d.port().await?,
            "ports": d.ports().await?,
            "gids": d.gids().await?,
            "caps": d.capabilities().await?,
            "lingering": d.lingering_objects().await?,
        }));
    }
    Ok(Value::Array(out))
}

async fn reload(connection: &Connection) -> Result<(), Error> {
    manager(connection).await?.reload().await?;
    println!("configuration reloaded");
    Ok(())
}

async fn pools(connection: &Connection) -> Result<Value, Error> {
    let pools = manager(connection).await?.list_pools().await?;
    Ok(Value::Array(
        pools
            .into_iter()
            .map(|p| {
                json!({
                    "pool": p.name,
                    "device": p.device,
                    "capacity": p.capacity,
                    "used": p.used,
                    "free": p.free,
                    "regions": p.regions,
                    "warm_regions": p.warm_regions,
                    "warm_bytes": p.warm_bytes,
                    "size_classes": p.size_classes,
                    "granularity": p.granularity,
                    "hugepages": p.hugepages,
                })
            })
            .collect(),
    ))
}

/// The command name of process `pid` as this host's /proc shows it now (`comm`), if it is
/// visible to the caller. rdmad reports the pid from the bus's credentials; the name is
/// read here because the daemon's unit hides other users' processes from it.
fn command_of(pid: u32) -> Option<String> {
    if pid == 0 {
        return None;
    }
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .ok()
        .map(|c| c.trim_end().to_owned())
}

async fn sessions(connection: &Connection) -> Result<Value, Error> {
    let sessions = manager(connection).await?.list_sessions().await?;
    Ok(Value::Array(
        sessions
            .into_iter()
            .map(|s| {
                json!({
                    "session": s.id,
                    "user": s.user,
                    "uid": s.uid,
                    "pid": s.pid,
                    "command": command_of(s.pid),
                    "bus_name": s.bus_name,
                    "regions": s.regions,
                    "attachments": s.attachments,
                    "registered_bytes": s.registered_bytes,
                    "created_usec": s.created_usec,
                })
            })
            .collect(),
    ))
}

async fn close_session(connection: &Connection, id: u64) -> Result<(), Error> {
    let session = SessionProxy::builder(connection)
        .path(session_path(id))?
        .build()
        .await?;
    session.close().await.map_err(|e| match e {
        Error::ZBus(zbus::Error::MethodError(name, _, _))
            if name.as_str() == "org.freedesktop.DBus.Error.UnknownObject" =>
        {
            Error::NoSuchObject(format!("there is no session {id}"))
        }
        other => other,
    })?;
    println!("session {id} closed");
    Ok(())
}

async fn regions(connection: &Connection) -> Result<Value, Error> {
    let regions = manager(connection).await?.list_regions().await?;
    Ok(Value::Array(
        regions
            .into_iter()
            .map(|r| {
                json!({
                    "region": r.id,
                    "session": object_id(r.session.as_str()),
                    "owner_uid": r.owner_uid,
                    "pool": r.pool,
                    "device": r.device,
                    "size": r.size,
                    "requested": r.requested,
                    "attachments": r.attachments,
                    "keys": r.keys.len(),
                })
            })
            .collect(),
    ))
}

async fn keys(connection: &Connection) -> Result<Value, Error> {
    let regions = manager(connection).await?.list_regions().await?;
    Ok(Value::Array(
        regions
            .into_iter()
            .flat_map(|r| r.keys)
            .map(|k| {
                json!({
                    "key": k.id,
                    "region": k.region,
                    "access": k.access,
                    "expires_usec": k.expires_usec,
                })
            })
            .collect(),
    ))
}

async fn revoke_key(connection: &Connection, id: u64) -> Result<(), Error> {
    manager(connection).await?.revoke_key(id).await?;
    println!("key {id} revoked");
    Ok(())
}

async fn quota(connection: &Connection, uid: u32) -> Result<Value, Error> {
    let entries = manager(connection).await?.get_quota(uid).await?;
    Ok(Value::Array(
        entries
            .into_iter()
            .map(|q| {
                json!({
                    "quota": q.name,
                    "limit": q.limit,
                    "used": q.used,
                    "source": q.source,
                })
            })
            .collect(),
    ))
}

/// A user name or uid; none means the caller.
fn resolve_user(user: Option<&str>) -> anyhow::Result<u32> {
    let Some(user) = user else {
        return Ok(nix::unistd::getuid().as_raw());
    };
    if let Ok(uid) = user.parse::<u32>() {
        return Ok(uid);
    }
    match nix::unistd::User::from_name(user) {
        Ok(Some(u)) => Ok(u.uid.as_raw()),
        _ => Err(anyhow!("there is no user named {user:?}")),
    }
}

async fn queue_pairs(connection: &Connection) -> Result<Value, Error> {
    let m = manager(connection).await?;
    let qps = m.list_queue_pairs().await?;
    // Which program holds each QP: its session's pid.
    let pids: std::collections::HashMap<u64, u32> = m
        .list_sessions()
        .await?
        .into_iter()
        .map(|s| (s.id, s.pid))
        .collect();
    Ok(Value::Array(
        qps.into_iter()
            .map(|q| {
                let session = object_id(q.session.as_str());
                let pid = session.and_then(|id| pids.get(&id).copied());
                json!({
                    "qp": q.id,
                    "session": session,
                    "pid": pid,
                    "command": pid.and_then(command_of),
                    "owner_uid": q.owner_uid,
                    "device": q.device,
                    "qpn": q.qp_num,
                    "state": q.state,
                    "send_depth": q.send_depth,
                    "recv_depth": q.recv_depth,
                    "peer": q.peer,
                    "posted": q.posted,
                    "completed": q.completed,
                    "failed": q.failed,
                    "refused": q.refused,
                })
            })
            .collect(),
    ))
}
