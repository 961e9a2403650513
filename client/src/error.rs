//! The errors rdmad replies with. Each variant is a real D-Bus error named
//! `org.rdmad1.Error.<Variant>` whose message says what to do about it. The daemon replies
//! with this very type, so the names exist in one place.

use zbus::DBusError;

use crate::names::BUS_NAME;

#[derive(Debug, DBusError)]
#[zbus(prefix = "org.rdmad1.Error")]
pub enum Error {
    /// Transport-level failure (not sent by rdmad itself).
    #[zbus(error)]
    ZBus(zbus::Error),
    /// The caller is not allowed to do this.
    NotAuthorized(String),
    /// A quota limit would be exceeded; the message names the limit, the current use and
    /// the configuration key that raises it.
    QuotaExceeded(String),
    /// The named object does not exist (or is not visible to the caller).
    NoSuchObject(String),
    /// An argument is malformed or out of range; the message names it.
    InvalidArgument(String),
    /// The pool has no room for the request.
    PoolExhausted(String),
    /// The device or provider does not support the operation.
    NotSupported(String),
    /// The device failed the operation.
    DeviceError(String),
    /// A connection by address failed: the peer rejected it (the message has its reason
    /// and what it said), nothing listens there, or the peer could not be reached or did
    /// not answer in time.
    ConnectionFailed(String),
}

impl Error {
    /// The D-Bus error name of a reply rdmad sent, e.g. `org.rdmad1.Error.NotAuthorized`,
    /// or of the underlying method error for transport failures.
    pub fn dbus_name(&self) -> Option<String> {
        match self {
            Error::ZBus(zbus::Error::MethodError(name, _, _)) => Some(name.to_string()),
            Error::ZBus(_) => None,
            other => Some(format!("org.rdmad1.Error.{}", other.variant_name())),
        }
    }

    fn variant_name(&self) -> &'static str {
        match self {
            Error::ZBus(_) => "ZBus",
            Error::NotAuthorized(_) => "NotAuthorized",
            Error::QuotaExceeded(_) => "QuotaExceeded",
            Error::NoSuchObject(_) => "NoSuchObject",
            Error::InvalidArgument(_) => "InvalidArgument",
            Error::PoolExhausted(_) => "PoolExhausted",
            Error::NotSupported(_) => "NotSupported",
            Error::DeviceError(_) => "DeviceError",
            Error::ConnectionFailed(_) => "ConnectionFailed",
        }
    }

    /// The human-readable message: rdmad's own text, or the transport's.
    pub fn message(&self) -> String {
        match self {
            Error::NotAuthorized(m)
            | Error::QuotaExceeded(m)
            | Error::NoSuchObject(m)
            | Error::InvalidArgument(m)
            | Error::PoolExhausted(m)
            | Error::NotSupported(m)
            | Error::DeviceError(m)
            | Error::ConnectionFailed(m) => m.clone(),
            _ if self.is_daemon_absent() => format!(
                "rdmad is not running: nothing owns {BUS_NAME} on this bus (start it: \
                 systemctl start rdmad); whatever an earlier instance lent is gone"
            ),
            _ if self.is_daemon_lost() => format!(
                "rdmad left the bus before it replied (it stopped, restarted or crashed); \
                 whatever it lent is gone: open a new session once {BUS_NAME} is back"
            ),
            Error::ZBus(zbus::Error::MethodError(name, Some(m), _))
                if name.as_str() == "org.freedesktop.DBus.Error.UnknownObject" =>
            {
                format!(
                    "{m}: it was released, or rdmad restarted since it was made (objects do \
                     not outlive the daemon instance that made them)"
                )
            }
            Error::ZBus(zbus::Error::MethodError(_, Some(m), _)) => m.clone(),
            Error::ZBus(other) => other.to_string(),
        }
    }

    /// True when rdmad went away while the call was waiting for its reply.
    pub fn is_daemon_lost(&self) -> bool {
        match self {
            // The bus's answer when the callee disconnects; its reply timeout says otherwise.
            Error::ZBus(zbus::Error::MethodError(name, m, _)) => {
                name.as_str() == "org.freedesktop.DBus.Error.NoReply"
                    && m.as_deref().is_some_and(|m| m.contains("disconnected"))
            }
            Error::ZBus(zbus::Error::FDO(e)) => {
                matches!(&**e, zbus::fdo::Error::NoReply(m) if m.contains("disconnected"))
            }
            _ => false,
        }
    }

    /// True when the failure means nobody owns `org.rdmad1` (the daemon is not running and
    /// could not be activated).
    pub fn is_daemon_absent(&self) -> bool {
        match self {
            Error::ZBus(zbus::Error::MethodError(name, _, _)) => matches!(
                name.as_str(),
                "org.freedesktop.DBus.Error.ServiceUnknown"
                    | "org.freedesktop.DBus.Error.NameHasNoOwner"
            ),
            Error::ZBus(zbus::Error::FDO(e)) => matches!(
                **e,
                zbus::fdo::Error::ServiceUnknown(_) | zbus::fdo::Error::NameHasNoOwner(_)
            ),
            _ => false,
        }
    }
}

impl From<zbus::fdo::Error> for Error {
    fn from(e: zbus::fdo::Error) -> Self {
        Error::ZBus(zbus::Error::FDO(Box::new(e)))
    }
}
