//! The caller's identity, from the bus daemon's credentials for the sender — never from
//! method arguments. Unique bus names are never reused, so credentials are cached per name
//! until the name leaves the bus. On a direct connection (`direct.rs`) the caller is the
//! one the connection was opened for, found by the connection's GUID; the headers there
//! are the peer's own, so their sender is never read.

use std::collections::HashMap;
use std::sync::Mutex;

use rdmad_client::Error;
use zbus::message::Header;
use zbus::Connection;

use crate::lock::lock;
use crate::policy::Caller;

#[derive(Debug, Default)]
pub struct CallerCache {
    known: Mutex<HashMap<String, Caller>>,
    /// The callers of direct connections, by the GUID of their connection.
    direct: Mutex<HashMap<String, Caller>>,
}

impl CallerCache {
    pub async fn caller(
        &self,
        connection: &Connection,
        header: &Header<'_>,
    ) -> Result<Caller, Error> {
        if !connection.is_bus() {
            // A direct connection: its peer writes the headers, so a sender on them means
            // nothing. The caller is the one the connection was opened for.
            return lock(&self.direct)
                .get(connection.server_guid().as_str())
                .cloned()
                .ok_or_else(|| {
                    Error::NotAuthorized("this connection was not opened by rdmad".into())
                });
        }
        let sender = header
            .sender()
            .ok_or_else(|| Error::NotAuthorized("the message carries no sender".into()))?;
        if let Some(known) = lock(&self.known).get(sender.as_str()) {
            return Ok(known.clone());
        }
        let dbus = zbus::fdo::DBusProxy::new(connection).await?;
        let credentials = dbus
            .get_connection_credentials(sender.clone().into())
            .await?;
        let uid = credentials.unix_user_id().ok_or_else(|| {
            Error::NotAuthorized("the bus did not report the caller's user id".into())
        })?;
        let caller = Caller {
            bus_name: sender.to_string(),
            uid,
            gids: credentials
                .unix_group_ids()
                .map(|gids| gids.to_vec())
                .unwrap_or_default(),
            pid: credentials.process_id(),
        };
        lock(&self.known).insert(caller.bus_name.clone(), caller.clone());
        Ok(caller)
    }

    /// Whether the bus connection `bus_name` is known (it called, and has not left).
    pub fn knows(&self, bus_name: &str) -> bool {
        lock(&self.known).contains_key(bus_name)
    }

    /// Makes `caller` the caller of every message on the direct connection `guid`.
    pub fn add_direct(&self, guid: &str, caller: Caller) {
        lock(&self.direct).insert(guid.to_owned(), caller);
    }

    pub fn forget_direct(&self, guid: &str) {
        lock(&self.direct).remove(guid);
    }

    /// Forgets a name that left the bus.
    pub fn forget(&self, bus_name: &str) {
        lock(&self.known).remove(bus_name);
    }
}
