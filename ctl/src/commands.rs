//! One function per `OBJECT COMMAND`.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::anyhow;
use rdmad_client::proxy::{DeviceProxy, ManagerProxy};
use rdmad_client::{Error, BUS_NAME};
use serde_json::{json, Value};
use zbus::Connection;

use crate::cli::{Cli, DevCommand, Object};
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
        Object::Dev { command } => {
            let name = match command {
                None | Some(DevCommand::Show { name: None }) => None,
                Some(DevCommand::Show { name: Some(n) }) => Some(n.as_str()),
            };
            devices(&connection, name).await.map(|v| printer.print(&v))
        }
        Object::Reload => reload(&connection).await,
    };
    result.map_err(|e| explain(e, &cli.bus))
}

/// Turns a failed call into one line a person can act on.
fn explain(e: Error, bus: &str) -> anyhow::Error {
    if e.is_daemon_absent() {
        return anyhow!("rdmad is not running (nothing owns {BUS_NAME} on the {bus} bus)");
    }
    match e {
        Error::ZBus(zbus::Error::MethodError(name, Some(msg), _)) => anyhow!("{msg} ({name})"),
        Error::ZBus(other) => anyhow!("{other}"),
        // rdmad's own errors carry a message written for people.
        Error::NotAuthorized(m)
        | Error::QuotaExceeded(m)
        | Error::NoSuchObject(m)
        | Error::InvalidArgument(m)
        | Error::PoolExhausted(m)
        | Error::NotSupported(m)
        | Error::DeviceError(m) => anyhow!("{m}"),
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
        }));
    }
    Ok(Value::Array(out))
}

async fn reload(connection: &Connection) -> Result<(), Error> {
    manager(connection).await?.reload().await?;
    println!("configuration reloaded");
    Ok(())
}
