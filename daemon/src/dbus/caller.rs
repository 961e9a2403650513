//! The caller's identity, from the bus daemon's credentials for the sender — never from
//! method arguments.

use rdmad_client::Error;
use zbus::message::Header;
use zbus::Connection;

use crate::policy::Caller;

pub async fn caller(connection: &Connection, header: &Header<'_>) -> Result<Caller, Error> {
    let sender = header
        .sender()
        .ok_or_else(|| Error::NotAuthorized("the message carries no sender".into()))?;
    let dbus = zbus::fdo::DBusProxy::new(connection).await?;
    let credentials = dbus
        .get_connection_credentials(sender.clone().into())
        .await?;
    let uid = credentials.unix_user_id().ok_or_else(|| {
        Error::NotAuthorized("the bus did not report the caller's user id".into())
    })?;
    Ok(Caller {
        bus_name: sender.to_string(),
        uid,
        gids: credentials
            .unix_group_ids()
            .map(|gids| gids.to_vec())
            .unwrap_or_default(),
        pid: credentials.process_id(),
    })
}
