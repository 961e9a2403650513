//! Noticing that rdmad went away. Everything a client holds from rdmad — sessions,
//! regions, keys, queue pairs, exports — belongs to one instance of the daemon, the
//! connection that owns `org.rdmad1`. When that instance exits (stop, restart, crash) the
//! bus announces that the name changed owner, and none of those objects exist any more,
//! even if a new instance takes the name a moment later.
//!
//! ```no_run
//! # async fn demo(connection: zbus::Connection) -> Result<(), rdmad_client::Error> {
//! let mut watch = rdmad_client::DaemonWatch::new(&connection).await?;
//! // … open a session, allocate, create queue pairs …
//! let gone = watch.gone().await;
//! eprintln!("{gone}"); // "rdmad (:1.4) left the bus: …"
//! # Ok(()) }
//! ```

use std::fmt;

use futures_util::StreamExt;
use zbus::fdo::{DBusProxy, NameOwnerChangedStream};

use crate::names::BUS_NAME;
use crate::Error;

/// Watches the owner of `org.rdmad1` as it was when the watch was made.
pub struct DaemonWatch {
    owner: Option<String>,
    changes: NameOwnerChangedStream,
}

impl fmt::Debug for DaemonWatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DaemonWatch")
            .field("owner", &self.owner)
            .finish_non_exhaustive()
    }
}

/// rdmad's instance left the bus; what a client held from it is gone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DaemonGone {
    /// The unique name of the instance that left.
    pub previous: String,
    /// The instance that owns the name now, if one took it already.
    pub current: Option<String>,
}

impl fmt::Display for DaemonGone {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.current {
            None => write!(f, "rdmad ({}) left the bus", self.previous)?,
            Some(now) => write!(f, "rdmad restarted ({} → {now})", self.previous)?,
        }
        write!(
            f,
            ": the sessions, regions, keys and queue pairs it lent are gone (mappings stay \
             readable but are no longer registered, and queue pair rings are no longer \
             served); open a new session"
        )
    }
}

impl std::error::Error for DaemonGone {}

impl DaemonWatch {
    /// Starts watching; fails if rdmad is not on the bus (see [`Error::is_daemon_absent`]).
    pub async fn new(connection: &zbus::Connection) -> Result<DaemonWatch, Error> {
        let dbus = DBusProxy::new(connection).await?;
        // Subscribe before asking, so that a change between the two is not missed.
        let changes = dbus
            .receive_name_owner_changed_with_args(&[(0, BUS_NAME)])
            .await?;
        let owner = dbus
            .get_name_owner(BUS_NAME.try_into().map_err(zbus::Error::from)?)
            .await?;
        Ok(DaemonWatch {
            owner: Some(owner.to_string()),
            changes,
        })
    }

    /// The unique name of the watched instance.
    pub fn owner(&self) -> &str {
        self.owner.as_deref().unwrap_or_default()
    }

    /// Resolves once the watched instance has given up `org.rdmad1` (or the connection to
    /// the bus ended, which has the same consequence for the caller).
    pub async fn gone(&mut self) -> DaemonGone {
        let previous = self.owner.clone().unwrap_or_default();
        while let Some(change) = self.changes.next().await {
            let Ok(args) = change.args() else { continue };
            let old = args.old_owner().as_ref().map(|n| n.to_string());
            if args.name() != BUS_NAME || old != self.owner {
                continue;
            }
            let current = args.new_owner().as_ref().map(|n| n.to_string());
            return DaemonGone { previous, current };
        }
        DaemonGone {
            previous,
            current: None,
        }
    }
}
