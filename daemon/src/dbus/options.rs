//! `options a{sv}`: every key is checked, so a typo is an error rather than silently
//! ignored.

use std::collections::HashMap;

use rdmad_client::Error;
use zbus::zvariant::{OwnedValue, Value};

pub struct Options<'a> {
    method: &'static str,
    map: &'a HashMap<String, OwnedValue>,
}

impl<'a> Options<'a> {
    /// Fails on a key not in `known`.
    pub fn new(
        method: &'static str,
        map: &'a HashMap<String, OwnedValue>,
        known: &[&str],
    ) -> Result<Options<'a>, Error> {
        if let Some(unknown) = map.keys().find(|k| !known.contains(&k.as_str())) {
            let known = if known.is_empty() {
                "it takes none".to_owned()
            } else {
                format!("known: {}", known.join(", "))
            };
            return Err(Error::InvalidArgument(format!(
                "{method}: unknown option {unknown:?} ({known})"
            )));
        }
        Ok(Options { method, map })
    }

    fn wrong_type(&self, key: &str, want: &str) -> Error {
        Error::InvalidArgument(format!("{}: option {key:?} must be {want}", self.method))
    }

    pub fn string(&self, key: &str) -> Result<Option<String>, Error> {
        match self.map.get(key).map(|v| &**v) {
            None => Ok(None),
            Some(Value::Str(s)) => Ok(Some(s.to_string())),
            Some(_) => Err(self.wrong_type(key, "a string (s)")),
        }
    }

    /// A byte array (`ay`), or a string taken as its UTF-8 bytes.
    pub fn bytes(&self, key: &str) -> Result<Option<Vec<u8>>, Error> {
        match self.map.get(key).map(|v| &**v) {
            None => Ok(None),
            Some(Value::Str(s)) => Ok(Some(s.as_bytes().to_vec())),
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| match v {
                    Value::U8(b) => Ok(*b),
                    _ => Err(self.wrong_type(key, "bytes (ay) or a string (s)")),
                })
                .collect::<Result<Vec<u8>, Error>>()
                .map(Some),
            Some(_) => Err(self.wrong_type(key, "bytes (ay) or a string (s)")),
        }
    }

    /// An unsigned integer of any D-Bus width.
    pub fn unsigned(&self, key: &str) -> Result<Option<u64>, Error> {
        match self.map.get(key).map(|v| &**v) {
            None => Ok(None),
            Some(Value::U64(n)) => Ok(Some(*n)),
            Some(Value::U32(n)) => Ok(Some(u64::from(*n))),
            Some(Value::U16(n)) => Ok(Some(u64::from(*n))),
            Some(Value::U8(n)) => Ok(Some(u64::from(*n))),
            Some(Value::I64(n)) if *n >= 0 => Ok(Some(*n as u64)),
            Some(Value::I32(n)) if *n >= 0 => Ok(Some(*n as u64)),
            Some(_) => Err(self.wrong_type(key, "a non-negative integer (t)")),
        }
    }
}
