//! Well-known names, object paths and interface names of the rdmad D-Bus API.

/// The bus name rdmad owns. The `1` is the API version, as in `org.freedesktop.login1`.
pub const BUS_NAME: &str = "org.rdmad1";
/// The root object: `org.rdmad1.Manager` and `org.freedesktop.DBus.ObjectManager`.
pub const MANAGER_PATH: &str = "/org/rdmad1";
/// Parent of the device objects.
pub const DEVICE_PATH_PREFIX: &str = "/org/rdmad1/device";

/// Parent of the pool objects.
pub const POOL_PATH_PREFIX: &str = "/org/rdmad1/pool";
/// Parent of the session objects (numbered, never reused).
pub const SESSION_PATH_PREFIX: &str = "/org/rdmad1/session";
/// Parent of the region objects (numbered, never reused).
pub const REGION_PATH_PREFIX: &str = "/org/rdmad1/region";
/// Parent of the queue-pair objects (numbered, never reused).
pub const QP_PATH_PREFIX: &str = "/org/rdmad1/qp";

pub const MANAGER_INTERFACE: &str = "org.rdmad1.Manager";
pub const DEVICE_INTERFACE: &str = "org.rdmad1.Device";
pub const POOL_INTERFACE: &str = "org.rdmad1.Pool";
pub const SESSION_INTERFACE: &str = "org.rdmad1.Session";
pub const REGION_INTERFACE: &str = "org.rdmad1.Region";
pub const QUEUE_PAIR_INTERFACE: &str = "org.rdmad1.QueuePair";

/// Environment variable naming the bus address clients use instead of the system bus.
pub const BUS_ADDRESS_ENV: &str = "RDMAD_BUS_ADDRESS";

/// Object path of a device. Device names may hold characters that are not allowed in an
/// object path element, so every byte outside `[A-Za-z0-9]` is written as `_xx` (lower-case
/// hex), the escaping systemd uses for unit paths on the bus.
pub fn device_path(device_name: &str) -> String {
    format!("{DEVICE_PATH_PREFIX}/{}", escape_path_element(device_name))
}

/// Object path of a pool.
pub fn pool_path(pool_name: &str) -> String {
    format!("{POOL_PATH_PREFIX}/{}", escape_path_element(pool_name))
}

pub fn session_path(id: u64) -> String {
    format!("{SESSION_PATH_PREFIX}/{id}")
}

pub fn region_path(id: u64) -> String {
    format!("{REGION_PATH_PREFIX}/{id}")
}

pub fn qp_path(id: u64) -> String {
    format!("{QP_PATH_PREFIX}/{id}")
}

/// The number at the end of a session or region path.
pub fn object_id(path: &str) -> Option<u64> {
    path.rsplit('/').next()?.parse().ok()
}

/// Escapes a string into a valid, non-empty object path element (reversible with
/// [`unescape_path_element`]).
pub fn escape_path_element(s: &str) -> String {
    if s.is_empty() {
        return "_".to_owned();
    }
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() {
            out.push(b as char);
        } else {
            out.push_str(&format!("_{b:02x}"));
        }
    }
    out
}

/// Reverses [`escape_path_element`]; `None` for an element it could not have produced.
pub fn unescape_path_element(s: &str) -> Option<String> {
    if s == "_" {
        return Some(String::new());
    }
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'_' {
            let hex = s.get(i + 1..i + 3)?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else if bytes[i].is_ascii_alphanumeric() {
            out.push(bytes[i]);
            i += 1;
        } else {
            return None;
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_paths_are_valid_and_reversible() {
        for name in ["rxe0", "mlx5_0", "lo-0", "a.b", "", "ünï"] {
            let path = device_path(name);
            zbus::zvariant::ObjectPath::try_from(path.as_str())
                .unwrap_or_else(|e| panic!("{path} is not a valid object path: {e}"));
            let element = path.rsplit('/').next().unwrap();
            assert_eq!(unescape_path_element(element).as_deref(), Some(name));
        }
        assert_eq!(device_path("mlx5_0"), "/org/rdmad1/device/mlx5_5f0");
        assert_eq!(device_path("rxe0"), "/org/rdmad1/device/rxe0");
    }

    #[test]
    fn unescape_rejects_malformed_elements() {
        assert_eq!(unescape_path_element("_zz"), None);
        assert_eq!(unescape_path_element("ab_4"), None);
    }
}
