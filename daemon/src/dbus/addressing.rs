//! What the connect-by-address methods (`Session.Listen`, `Session.Accept`,
//! `QueuePair.ConnectTo`) share: reading addresses and private data from the bus, and the
//! dictionary that describes a connection. (How many connections by address one user has
//! under way at once is bounded in `turns.rs`.)

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use rdmad_client::Error;
use zbus::zvariant::{OwnedValue, Value};

use super::options::Options;
use crate::engine::Connected;

/// The longest a caller may ask to wait for a connection.
pub const MAX_WAIT: Duration = Duration::from_secs(600);

/// An IP address as a caller wrote it; `""` is any address (listening) or none.
pub fn ip(method: &str, what: &str, text: &str) -> Result<Option<IpAddr>, Error> {
    if text.is_empty() {
        return Ok(None);
    }
    text.trim_start_matches('[')
        .trim_end_matches(']')
        .parse()
        .map(Some)
        .map_err(|_| {
            Error::InvalidArgument(format!(
                "{method}: {what} {text:?} is not an IPv4 or IPv6 address (e.g. 192.0.2.1 or \
                 fd00::1; host names are not resolved)"
            ))
        })
}

/// Option `timeout_ms`, or `default`, at most [`MAX_WAIT`].
pub fn timeout(method: &str, opts: &Options<'_>, default: Duration) -> Result<Duration, Error> {
    match opts.unsigned("timeout_ms")? {
        None => Ok(default),
        Some(0) => Err(Error::InvalidArgument(format!(
            "{method}: timeout_ms must be at least 1"
        ))),
        Some(ms) if Duration::from_millis(ms) > MAX_WAIT => Err(Error::InvalidArgument(format!(
            "{method}: timeout_ms {ms} is more than {} (ten minutes)",
            MAX_WAIT.as_millis()
        ))),
        Some(ms) => Ok(Duration::from_millis(ms)),
    }
}

fn owned(v: Value<'_>) -> Result<OwnedValue, Error> {
    OwnedValue::try_from(v).map_err(|e| Error::DeviceError(format!("internal error: {e}")))
}

/// A connection as the methods return it: `address` and `port` of the peer,
/// `local_address` and `local_port`, the peer's `qp_num` and the `private_data` it sent.
pub fn describe(c: &Connected) -> Result<HashMap<String, OwnedValue>, Error> {
    let mut d = HashMap::new();
    let mut put_addr = |key: &str, port_key: &str, a: Option<SocketAddr>| -> Result<(), Error> {
        if let Some(a) = a {
            d.insert(key.to_owned(), owned(Value::from(a.ip().to_string()))?);
            d.insert(port_key.to_owned(), owned(Value::from(a.port()))?);
        }
        Ok(())
    };
    put_addr("address", "port", c.peer)?;
    put_addr("local_address", "local_port", c.local)?;
    d.insert("qp_num".into(), owned(Value::from(c.peer_qp_num))?);
    d.insert(
        "private_data".into(),
        owned(Value::from(c.private_data.clone()))?,
    );
    Ok(d)
}
