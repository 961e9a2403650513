//! Printing: JSON for scripts, text for people, built from the same value so the keys
//! match. Text shows a single object one `key value` pair per line, and a list one object
//! per line (iproute2 style); nested lists go on indented lines beneath.

use serde_json::{Map, Value};

pub struct Printer {
    pub json: bool,
    pub pretty: bool,
}

impl Printer {
    pub fn print(&self, value: &Value) {
        if self.json {
            let text = if self.pretty {
                serde_json::to_string_pretty(value)
            } else {
                serde_json::to_string(value)
            };
            println!("{}", text.expect("a serde_json::Value always serializes"));
            return;
        }
        match value {
            Value::Array(items) => {
                for item in items {
                    print_record(item);
                }
            }
            Value::Object(map) => {
                for (key, v) in map {
                    println!("{key} {}", scalar(v));
                }
            }
            other => println!("{}", scalar(other)),
        }
    }
}

/// One object: its scalar fields on one line, each nested list item or object on an
/// indented line of its own.
fn print_record(item: &Value) {
    let Value::Object(map) = item else {
        println!("{}", scalar(item));
        return;
    };
    println!("{}", pairs(map));
    for (key, v) in map {
        match v {
            Value::Array(list) if list.iter().all(Value::is_object) => {
                for entry in list {
                    if let Value::Object(m) = entry {
                        println!("    {key} {}", pairs(m));
                    }
                }
            }
            Value::Object(m) => println!("    {key} {}", pairs(m)),
            _ => {}
        }
    }
}

fn pairs(map: &Map<String, Value>) -> String {
    map.iter()
        .filter(|(_, v)| !v.is_object() && !is_object_list(v))
        .map(|(k, v)| format!("{k} {}", scalar(v)))
        .collect::<Vec<_>>()
        .join(" ")
}

fn is_object_list(v: &Value) -> bool {
    matches!(v, Value::Array(list) if !list.is_empty() && list.iter().all(Value::is_object))
}

fn scalar(v: &Value) -> String {
    match v {
        Value::String(s) if s.is_empty() || s.contains(char::is_whitespace) => format!("{s:?}"),
        Value::String(s) => s.clone(),
        Value::Array(list) if list.is_empty() => "none".to_owned(),
        Value::Array(list) => list.iter().map(scalar).collect::<Vec<_>>().join(","),
        other => other.to_string(),
    }
}
