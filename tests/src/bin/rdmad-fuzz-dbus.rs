//! `rdmad-fuzz-dbus`: calls every method of every interface rdmad serves with random well-
//! and ill-typed arguments, as an ordinary client of the bus, and checks every reply.
//!
//! ```text
//! rdmad-fuzz-dbus --bus ADDRESS [--seed N] [--calls N] [--workers N] [--connections N]
//!                 [--direct] [--spare-uid UID]... [--timeout SECS] [--quiet] [--verbose]
//!                 [--summary]
//! ```
//!
//! It discovers the objects by introspection (`Introspect` from `/org/rdmad1` down, and
//! `GetManagedObjects`), then `--workers` tasks (default 4) sharing `--connections` bus
//! connections (default 2) make `--calls` calls in all (default 10000): a path, one of its
//! interfaces (every `org.rdmad1.*` one, `Properties`, `Introspectable`, `Peer`,
//! `ObjectManager`) and a method, with
//!
//! - well-typed arguments (≈70%) for the introspected signature, the values biased to the
//!   interesting ones: 0, 1, the largest and negative integers, empty, huge, unicode and
//!   path-like strings, access keys, ids and object paths seen in earlier replies, endpoints
//!   of real queue pairs, `a{sv}` options with the documented names (right and wrong
//!   variant types) and unknown ones; `Properties.Get/Set/GetAll` with real and bogus
//!   interface and property names;
//! - ill-typed arguments (≈30%): a random signature (descriptors included), one argument
//!   missing, one too many, or one of the wrong type; and, now and then, made-up paths,
//!   interfaces and methods, and calls without an interface.
//!
//! Replies that create objects (sessions, regions, queue pairs, keys, exports) and every
//! object path, access key and id in any reply feed the pools the arguments are drawn from,
//! so the calls reach real objects: open, allocate, share, attach, connect, export, revoke,
//! release, detach, free, destroy, close. Now and then a connection is closed and replaced
//! while calls are in flight, so the daemon's clean-up of departed clients races with
//! everything else. Messages stay within the system bus's limits (16 descriptors, well
//! under 32 MiB), which a bus enforces by disconnecting the sender.
//!
//! Every reply must be a method return whose signature is the introspected one, an
//! `org.rdmad1.Error.*` error rdmad documents (with a message), or an
//! `org.freedesktop.DBus.Error.*` error; anything else is a finding — except zbus's own
//! `org.freedesktop.zbus.Error` for arguments it cannot decode before any rdmad code runs,
//! which is counted ("undecodable") and reported. No reply within `--timeout` seconds
//! (default 60), `NoReply`, or the daemon leaving the bus is a failure.
//!
//! `--direct`: every connection is a direct one (`Manager.OpenDirect` on a fresh bus
//! connection, then peer to peer), so the calls reach rdmad without the bus daemon between
//! — nothing checks their messages on the way.
//!
//! `--spare-uid UID` (repeatable): never call `Session.Close` on a session of that user that
//! this process did not open (asked with `Session.GetInfo` first), so a well-behaved
//! client of that user can run alongside an administrator's fuzzer.
//!
//! It prints the seed first, then (unless `--quiet`) per method the calls, the success
//! replies, the ill-typed calls and each error name, then the total calls per second and
//! every finding and failure; `--summary` adds a line `summary {JSON}` with the same counts,
//! `--verbose` a line per call. Exit status: 0 clean, 1 findings, 2 a failure (the daemon
//! stopped answering), 3 bad usage or no connection.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::os::fd::OwnedFd;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdmad_tests::rng::Rng;
use serde_json::json;
use zbus::zvariant::{Array, Dict, Fd, ObjectPath, Signature, Structure, StructureBuilder, Value};
use zbus::Connection;

const BUS_NAME: &str = "org.rdmad1";
const ROOT: &str = "/org/rdmad1";
const PROPERTIES: &str = "org.freedesktop.DBus.Properties";
const INTROSPECTABLE: &str = "org.freedesktop.DBus.Introspectable";
const OBJECT_MANAGER: &str = "org.freedesktop.DBus.ObjectManager";
const SESSION: &str = "org.rdmad1.Session";
/// The errors rdmad documents (docs/dbus-api.md).
const RDMAD_ERRORS: [&str; 7] = [
    "NotAuthorized",
    "QuotaExceeded",
    "NoSuchObject",
    "InvalidArgument",
    "PoolExhausted",
    "NotSupported",
    "DeviceError",
];
/// Errors that mean the daemon is gone or stuck rather than refusing a call.
const FAILURES: [&str; 6] = [
    "org.freedesktop.DBus.Error.NoReply",
    "org.freedesktop.DBus.Error.ServiceUnknown",
    "org.freedesktop.DBus.Error.NameHasNoOwner",
    "org.freedesktop.DBus.Error.Disconnected",
    "org.freedesktop.DBus.Error.Timeout",
    "org.freedesktop.DBus.Error.TimedOut",
];
/// Most entries kept in each pool of seen values.
const POOL_CAP: usize = 256;
/// Most objects remembered.
const MAX_OBJECTS: usize = 1024;

// ---------------------------------------------------------------------------------------
// Command line

struct Args {
    bus: String,
    seed: u64,
    calls: u64,
    workers: usize,
    connections: usize,
    direct: bool,
    spare_uids: Vec<u32>,
    timeout: Duration,
    quiet: bool,
    verbose: bool,
    summary: bool,
}

fn usage() -> ! {
    eprintln!(
        "usage: rdmad-fuzz-dbus --bus ADDRESS [--seed N] [--calls N] [--workers N] \
         [--connections N] [--direct] [--spare-uid UID]... [--timeout SECS] [--quiet] \
         [--verbose] [--summary]"
    );
    std::process::exit(3)
}

fn parse_args() -> Args {
    let mut args = Args {
        bus: String::new(),
        seed: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64),
        calls: 10_000,
        workers: 4,
        connections: 2,
        direct: false,
        spare_uids: Vec::new(),
        timeout: Duration::from_secs(60),
        quiet: false,
        verbose: false,
        summary: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().unwrap_or_else(|| usage());
        fn num<T: FromStr>(s: String) -> T {
            s.parse().unwrap_or_else(|_| usage())
        }
        match flag.as_str() {
            "--bus" => args.bus = value(),
            "--seed" => args.seed = num(value()),
            "--calls" => args.calls = num(value()),
            "--workers" => args.workers = num::<usize>(value()).max(1),
            "--connections" => args.connections = num::<usize>(value()).max(1),
            "--direct" => args.direct = true,
            "--spare-uid" => args.spare_uids.push(num(value())),
            "--timeout" => args.timeout = Duration::from_secs(num(value())),
            "--quiet" => args.quiet = true,
            "--verbose" => args.verbose = true,
            "--summary" => args.summary = true,
            "-h" | "--help" => usage(),
            _ => usage(),
        }
    }
    if args.bus.is_empty() {
        usage()
    }
    args
}

// ---------------------------------------------------------------------------------------
// Random numbers: the tests' seeded generator (`rdmad_tests::rng`).

/// The generator a fuzzer seed names: the tests' splitmix64 one, seeded with `seed`, its
/// first draw dropped (as this fuzzer always did, so the seeds earlier runs printed replay
/// the same calls).
fn seeded(seed: u64) -> Rng {
    let mut rng = Rng::new(seed);
    rng.next_u64();
    rng
}

// ---------------------------------------------------------------------------------------
// Introspection data

#[derive(Debug, Clone)]
struct Method {
    name: String,
    /// `(argument name, type)` of the in arguments.
    inputs: Vec<(String, Signature)>,
    /// The out arguments' types, concatenated.
    outputs: String,
}

#[derive(Debug, Clone, Default)]
struct Interface {
    methods: Vec<Method>,
    /// `(name, type, writable)`.
    properties: Vec<(String, Signature, bool)>,
}

#[derive(Debug, Default)]
struct Introspection {
    /// Definitions of every interface the document describes.
    interfaces: Vec<(String, Interface)>,
    /// Every node: its path relative to the introspected one (`""` for itself) and the
    /// names of its interfaces, `None` when the document only names the node.
    nodes: Vec<(String, Option<Vec<String>>)>,
}

fn xml_unescape(s: &str) -> String {
    s.replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&quot;", "\"")
        .replace("&apos;", "'")
        .replace("&amp;", "&")
}

/// A tag of an XML document.
struct Tag {
    name: String,
    attrs: HashMap<String, String>,
    closing: bool,
    self_closing: bool,
}

/// The tags of an XML document. Enough for D-Bus introspection data, whose text content
/// (comments) does not matter.
fn xml_tags(xml: &str) -> Vec<Tag> {
    let mut tags = Vec::new();
    let mut rest = xml;
    while let Some(start) = rest.find('<') {
        rest = &rest[start..];
        if let Some(body) = rest.strip_prefix("<!--") {
            rest = body.find("-->").map_or("", |end| &body[end + 3..]);
            continue;
        }
        // The closing '>' outside quotes.
        let mut quote = None;
        let mut end = None;
        for (i, c) in rest.char_indices().skip(1) {
            match (quote, c) {
                (None, '"' | '\'') => quote = Some(c),
                (Some(q), c) if c == q => quote = None,
                (None, '>') => {
                    end = Some(i);
                    break;
                }
                _ => {}
            }
        }
        let Some(end) = end else { break };
        let inner = &rest[1..end];
        rest = &rest[end + 1..];
        if inner.starts_with('!') || inner.starts_with('?') {
            continue;
        }
        let closing = inner.starts_with('/');
        let self_closing = inner.ends_with('/');
        let inner = inner.trim_start_matches('/').trim_end_matches('/');
        let name_end = inner
            .find(|c: char| c.is_whitespace())
            .unwrap_or(inner.len());
        let name = inner[..name_end].to_owned();
        let mut attrs = HashMap::new();
        let mut a = &inner[name_end..];
        while let Some(eq) = a.find('=') {
            let key = a[..eq].trim().to_owned();
            let after = a[eq + 1..].trim_start();
            let Some(q) = after.chars().next().filter(|c| *c == '"' || *c == '\'') else {
                break;
            };
            let Some(close) = after[1..].find(q) else {
                break;
            };
            attrs.insert(key, xml_unescape(&after[1..1 + close]));
            a = &after[close + 2..];
        }
        tags.push(Tag {
            name,
            attrs,
            closing,
            self_closing,
        });
    }
    tags
}

fn parse_introspection(xml: &str) -> Introspection {
    let mut out = Introspection::default();
    // The open nodes below the introspected one, and the index of each in `out.nodes`.
    let mut stack: Vec<(String, usize)> = Vec::new();
    let mut depth = 0usize;
    let mut iface: Option<(String, Interface)> = None;
    let mut method: Option<Method> = None;
    for tag in xml_tags(xml) {
        let attr = |k: &str| tag.attrs.get(k).cloned().unwrap_or_default();
        match (tag.name.as_str(), tag.closing) {
            ("node", false) => {
                let relative = if depth == 0 {
                    String::new()
                } else {
                    let parent = stack.last().map_or("", |(p, _)| p.as_str());
                    if parent.is_empty() {
                        attr("name")
                    } else {
                        format!("{parent}/{}", attr("name"))
                    }
                };
                if tag.self_closing {
                    out.nodes.push((relative, None));
                } else {
                    out.nodes.push((relative.clone(), Some(Vec::new())));
                    stack.push((relative, out.nodes.len() - 1));
                    depth += 1;
                }
            }
            ("node", true) => {
                stack.pop();
                depth = depth.saturating_sub(1);
            }
            ("interface", false) => {
                let name = attr("name");
                if let Some((_, i)) = stack.last() {
                    if let Some(list) = out.nodes[*i].1.as_mut() {
                        list.push(name.clone());
                    }
                }
                iface = Some((name, Interface::default()));
                if tag.self_closing {
                    out.interfaces.extend(iface.take());
                }
            }
            ("interface", true) => out.interfaces.extend(iface.take()),
            ("method", false) => {
                let m = Method {
                    name: attr("name"),
                    inputs: Vec::new(),
                    outputs: String::new(),
                };
                if tag.self_closing {
                    if let Some((_, i)) = iface.as_mut() {
                        i.methods.push(m);
                    }
                } else {
                    method = Some(m);
                }
            }
            ("method", true) => {
                if let (Some(m), Some((_, i))) = (method.take(), iface.as_mut()) {
                    i.methods.push(m);
                }
            }
            ("arg", false) => {
                if let Some(m) = method.as_mut() {
                    let ty = attr("type");
                    if attr("direction") == "out" {
                        m.outputs.push_str(&ty);
                    } else if let Ok(sig) = Signature::from_str(&ty) {
                        m.inputs.push((attr("name"), sig));
                    }
                }
            }
            ("property", false) => {
                if let (Some((_, i)), Ok(sig)) =
                    (iface.as_mut(), Signature::from_str(&attr("type")))
                {
                    i.properties
                        .push((attr("name"), sig, attr("access").contains("write")));
                }
            }
            _ => {}
        }
    }
    out
}

// ---------------------------------------------------------------------------------------
// What the fuzzer knows: interfaces, objects, and values seen in replies

#[derive(Debug, Clone)]
struct Object {
    interfaces: Vec<String>,
    /// Unique name of the connection of this process that created (or attached) it.
    owner: Option<String>,
}

/// A bounded set of seen values: when full, a random old one is replaced. Half the picks
/// are among the most recent ones, which are the most likely to be still valid.
#[derive(Debug)]
struct Seen<T> {
    items: Vec<T>,
    recent: std::collections::VecDeque<T>,
}

impl<T: PartialEq + Clone> Seen<T> {
    fn new() -> Seen<T> {
        Seen {
            items: Vec::new(),
            recent: std::collections::VecDeque::new(),
        }
    }

    fn add(&mut self, value: T, rng: &mut Rng) {
        if self.recent.len() == 8 {
            self.recent.pop_front();
        }
        self.recent.push_back(value.clone());
        if self.items.contains(&value) {
            return;
        }
        if self.items.len() < POOL_CAP {
            self.items.push(value);
        } else {
            let i = rng.below(POOL_CAP);
            self.items[i] = value;
        }
    }

    fn pick(&self, rng: &mut Rng) -> Option<T> {
        if !self.recent.is_empty() && rng.chance(0.5) {
            return self.recent.get(rng.below(self.recent.len())).cloned();
        }
        (!self.items.is_empty()).then(|| rng.pick(&self.items).clone())
    }
}

type Endpoint = (String, u32, u32, u32, u32, u16);

#[derive(Debug, Default, Clone, serde::Serialize)]
struct MethodStats {
    calls: u64,
    ok: u64,
    ill_typed: u64,
    errors: BTreeMap<String, u64>,
}

struct Known {
    interfaces: HashMap<String, Interface>,
    objects: BTreeMap<String, Object>,
    /// Interfaces of the children of a parent path, once one child was introspected.
    classes: HashMap<String, Vec<String>>,
    dead: Seen<String>,
    /// Regions this process attached, queue pairs it connected.
    attached: HashSet<String>,
    connected: HashSet<String>,
    /// Access keys of regions not known to be gone, with their region.
    live_tokens: Vec<(String, String)>,
    /// Key and export ids of regions this process shared and exported.
    region_keys: HashMap<String, Vec<u64>>,
    region_exports: HashMap<String, Vec<u64>>,
    pools: Seen<String>,
    devices: Seen<String>,
    tokens: Seen<String>,
    names: Seen<String>,
    strings: Seen<String>,
    numbers: Seen<u64>,
    key_ids: Seen<u64>,
    export_ids: Seen<u64>,
    endpoints: Seen<Endpoint>,
    /// Owners of sessions, from `Session.GetInfo` (for `--spare-uid`).
    session_uids: HashMap<String, u32>,
    stats: BTreeMap<String, MethodStats>,
    findings: Vec<String>,
    failures: Vec<String>,
    spared: u64,
    aborted: u64,
    unsendable: u64,
    zbus_refusals: u64,
    rng: Rng,
}

impl Known {
    fn new(seed: u64) -> Known {
        Known {
            interfaces: HashMap::new(),
            objects: BTreeMap::new(),
            classes: HashMap::new(),
            dead: Seen::new(),
            attached: HashSet::new(),
            connected: HashSet::new(),
            live_tokens: Vec::new(),
            region_keys: HashMap::new(),
            region_exports: HashMap::new(),
            pools: Seen::new(),
            devices: Seen::new(),
            tokens: Seen::new(),
            names: Seen::new(),
            strings: Seen::new(),
            numbers: Seen::new(),
            key_ids: Seen::new(),
            export_ids: Seen::new(),
            endpoints: Seen::new(),
            session_uids: HashMap::new(),
            stats: BTreeMap::new(),
            findings: Vec::new(),
            failures: Vec::new(),
            spared: 0,
            aborted: 0,
            unsendable: 0,
            zbus_refusals: 0,
            rng: seeded(seed ^ 0x5eed),
        }
    }

    fn parent(path: &str) -> String {
        match path.rfind('/') {
            Some(0) | None => "/".to_owned(),
            Some(i) => path[..i].to_owned(),
        }
    }

    /// Records an object path seen somewhere; its interfaces are guessed from a sibling
    /// that was introspected, else learnt when it is introspected.
    fn add_path(&mut self, path: &str, owner: Option<&str>) {
        if !path.starts_with(ROOT) || self.dead.items.iter().any(|d| d == path) {
            return;
        }
        let mut rng = seeded(self.rng.next_u64());
        for (prefix, seen) in [
            ("/org/rdmad1/pool/", &mut self.pools),
            ("/org/rdmad1/device/", &mut self.devices),
        ] {
            if let Some(name) = path
                .strip_prefix(prefix)
                .and_then(rdmad_client::names::unescape_path_element)
            {
                seen.add(name, &mut rng);
            }
        }
        let interfaces = self
            .classes
            .get(&Self::parent(path))
            .cloned()
            .unwrap_or_default();
        let entry = self
            .objects
            .entry(path.to_owned())
            .or_insert_with(|| Object {
                interfaces,
                owner: None,
            });
        if let Some(owner) = owner {
            entry.owner = Some(owner.to_owned());
        }
        // Objects that went away unnoticed (closed by others) are forgotten now and then.
        if self.objects.len() > MAX_OBJECTS {
            let i = rng.below(self.objects.len());
            if let Some(victim) = self.objects.keys().nth(i).cloned() {
                if victim != path && rdmad_client::names::object_id(&victim).is_some() {
                    self.bury(&victim);
                }
            }
        }
    }

    fn learn(&mut self, path: &str, data: Introspection) {
        for (name, iface) in data.interfaces {
            self.interfaces.insert(name, iface);
        }
        for (relative, names) in data.nodes {
            let node = match (path, relative.as_str()) {
                (_, "") => path.to_owned(),
                ("/", r) => format!("/{r}"),
                (p, r) => format!("{p}/{r}"),
            };
            let Some(names) = names else {
                self.add_path(&node, None);
                continue;
            };
            if node != ROOT && names.iter().any(|n| n.starts_with("org.rdmad1.")) {
                self.classes.insert(Self::parent(&node), names.clone());
            }
            self.objects
                .entry(node)
                .or_insert_with(|| Object {
                    interfaces: Vec::new(),
                    owner: None,
                })
                .interfaces = names;
        }
    }

    fn bury(&mut self, path: &str) {
        self.attached.remove(path);
        self.connected.remove(path);
        self.session_uids.remove(path);
        self.region_keys.remove(path);
        self.live_tokens.retain(|(_, region)| region != path);
        self.region_exports.remove(path);
        if self.objects.remove(path).is_some() {
            let mut rng = seeded(self.rng.next_u64());
            self.dead.add(path.to_owned(), &mut rng);
        }
    }

    fn stats(&mut self, label: &str) -> &mut MethodStats {
        self.stats.entry(label.to_owned()).or_default()
    }

    /// Takes in everything a successful reply holds.
    fn harvest(&mut self, label: &str, path: &str, owner: &str, fields: &[Value<'_>]) {
        let mut rng = seeded(self.rng.next_u64());
        let creates = matches!(
            label,
            "org.rdmad1.Manager.OpenSession"
                | "org.rdmad1.Session.AllocateRegion"
                | "org.rdmad1.Session.AttachRegion"
                | "org.rdmad1.Session.CreateQueuePair"
        );
        match label {
            "org.rdmad1.Region.Share" => {
                if let Some(Value::Str(token)) = fields.first() {
                    if self.live_tokens.len() >= POOL_CAP {
                        self.live_tokens.remove(0);
                    }
                    self.live_tokens.push((token.to_string(), path.to_owned()));
                }
                if let Some(Value::U64(id)) = fields.get(1) {
                    self.key_ids.add(*id, &mut rng);
                    self.region_keys
                        .entry(path.to_owned())
                        .or_default()
                        .push(*id);
                }
            }
            "org.rdmad1.Region.ExportRemote" => {
                if let Some(Value::U64(id)) = fields.get(3) {
                    self.export_ids.add(*id, &mut rng);
                    self.region_exports
                        .entry(path.to_owned())
                        .or_default()
                        .push(*id);
                }
            }
            "org.rdmad1.Session.AttachRegion" => {
                if let Some(Value::ObjectPath(p)) = fields.first() {
                    self.attached.insert(p.to_string());
                }
            }
            "org.rdmad1.Region.Detach" => {
                self.attached.remove(path);
            }
            "org.rdmad1.QueuePair.Connect" => {
                self.connected.insert(path.to_owned());
            }
            "org.rdmad1.Session.Close"
            | "org.rdmad1.Region.Free"
            | "org.rdmad1.QueuePair.Destroy" => self.bury(path),
            "org.rdmad1.Session.GetInfo" => {
                if let Some(Value::U32(uid)) = fields.get(2) {
                    self.session_uids.insert(path.to_owned(), *uid);
                }
            }
            _ => {}
        }
        for (i, v) in fields.iter().enumerate() {
            let own = creates && i == 0;
            self.walk(v, &mut rng, own.then_some(owner));
        }
    }

    fn walk(&mut self, v: &Value<'_>, rng: &mut Rng, owner: Option<&str>) {
        match v {
            Value::ObjectPath(p) => self.add_path(p.as_str(), owner),
            Value::Str(s) => {
                let s = s.as_str();
                if s.starts_with("rdk1_") {
                    self.tokens.add(s.to_owned(), rng);
                } else if !s.is_empty()
                    && s.len() <= 40
                    && s.chars()
                        .all(|c| c.is_ascii_alphanumeric() || "_-.:".contains(c))
                {
                    self.names.add(s.to_owned(), rng);
                } else if s.len() <= 200 {
                    self.strings.add(s.to_owned(), rng);
                }
            }
            Value::U64(n) => self.numbers.add(*n, rng),
            Value::U32(n) => self.numbers.add(u64::from(*n), rng),
            Value::Value(inner) => self.walk(inner, rng, None),
            Value::Array(a) => {
                for e in a.inner() {
                    self.walk(e, rng, None);
                }
            }
            Value::Dict(d) => {
                for (k, v) in d.iter() {
                    self.walk(k, rng, None);
                    self.walk(v, rng, None);
                }
            }
            Value::Structure(s) => {
                let f = s.fields();
                match f {
                    // An endpoint (suuuuq).
                    [Value::Str(gid), Value::U32(gi), Value::U32(qpn), Value::U32(psn), Value::U32(mtu), Value::U16(lid)] =>
                    {
                        self.endpoints
                            .add((gid.to_string(), *gi, *qpn, *psn, *mtu, *lid), rng);
                    }
                    // A key (ttst): id, region, access, expiry.
                    [Value::U64(id), Value::U64(_), Value::Str(_), Value::U64(_)] => {
                        self.key_ids.add(*id, rng);
                    }
                    _ => {}
                }
                for x in f {
                    self.walk(x, rng, None);
                }
            }
            _ => {}
        }
    }
}

// ---------------------------------------------------------------------------------------
// Values

/// Interesting unsigned values of each width.
const U64S: [u64; 16] = [
    0,
    1,
    2,
    3,
    7,
    64,
    4095,
    4096,
    4097,
    65536,
    1 << 20,
    (1 << 20) + 1,
    u32::MAX as u64,
    1 << 32,
    i64::MAX as u64,
    u64::MAX,
];
const SIZES: [u64; 14] = [
    0,
    1,
    100,
    4095,
    4096,
    4097,
    5000,
    65536,
    65537,
    1 << 20,
    (1 << 20) + 1,
    8 << 20,
    u64::MAX,
    1 << 63,
];
const WORDS: [&str; 24] = [
    "ro",
    "rw",
    "r",
    "w",
    "a",
    "rwa",
    "wr",
    "x",
    "RO",
    "fuzz",
    "fine",
    "witness",
    "default",
    "loopback0",
    "rxe0",
    "mlx5_0",
    "org.rdmad1.Manager",
    "org.rdmad1.Session",
    "Version",
    "ObjectCounts",
    "nobody",
    "root",
    "::ffff:127.0.0.1",
    "fe80::1",
];
const PATHISH: [&str; 12] = [
    "/org/rdmad1",
    "/org/rdmad1/session/1",
    "/org/rdmad1/../../etc/passwd",
    "../../../../etc/shadow",
    "/proc/self/fd/0",
    "/dev/infiniband/uverbs0",
    "%s%s%n%x",
    "loopback0\n",
    " default",
    "default ",
    "C:\\Windows",
    "\u{202e}default",
];
/// Options each method knows, with the type each wants (docs/dbus-api.md).
const OPTIONS: [(&str, &[(&str, char)]); 5] = [
    ("Share", &[("access", 's'), ("expires_in", 't')]),
    ("ExportRemote", &[("access", 's')]),
    (
        "CreateQueuePair",
        &[
            ("send_depth", 'u'),
            ("recv_depth", 'u'),
            ("max_sge", 'u'),
            ("max_inline", 'u'),
            ("domain", 'u'),
        ],
    ),
    (
        "Register",
        &[
            ("domain", 'u'),
            ("offset", 't'),
            ("length", 't'),
            ("iova", 't'),
            ("access", 's'),
        ],
    ),
    ("Ready", &[("psn", 'u')]),
];
const ALL_OPTION_NAMES: [&str; 12] = [
    "access",
    "expires_in",
    "send_depth",
    "recv_depth",
    "max_sge",
    "max_inline",
    "domain",
    "offset",
    "length",
    "iova",
    "psn",
    "flags",
];

/// What argument generation needs besides the signature.
struct Gen<'k> {
    known: &'k Known,
    rng: &'k mut Rng,
    /// The method being called (its bare name).
    method: String,
    /// The object being called: its interfaces (for `Properties`).
    object_interfaces: Vec<String>,
    /// The interface named in the first argument of `Properties.*`.
    prop_iface: Option<String>,
    /// The unique name of the connection the call goes on.
    me: String,
    /// The object called.
    path: String,
    /// Bytes of strings left for this call, to keep messages well under the bus's limits.
    budget: usize,
    /// New descriptors this call may still carry.
    fds_left: usize,
}

fn is_noncharacter(c: u32) -> bool {
    (0xfdd0..=0xfdef).contains(&c) || (c & 0xfffe) == 0xfffe
}

fn random_char(rng: &mut Rng) -> char {
    loop {
        let c = match rng.below(6) {
            0 => rng.range(1, 0x7f) as u32,
            1 => rng.range(0x80, 0x7ff) as u32,
            2 => rng.range(0x800, 0xffff) as u32,
            3 => rng.range(0x1_0000, 0x10_ffff) as u32,
            4 => *rng.pick(&[0x300, 0x301, 0x200b, 0x200d, 0x202e, 0xfeff, 0x1f600]),
            _ => rng.range(0x20, 0x7e) as u32,
        };
        if is_noncharacter(c) {
            continue;
        }
        if let Some(ch) = char::from_u32(c) {
            return ch;
        }
    }
}

fn random_name_element(rng: &mut Rng) -> String {
    const FIRST: &[u8] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_";
    const REST: &[u8] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_0123456789";
    let len = rng.range(1, 12);
    let mut s = String::new();
    s.push(*rng.pick(FIRST) as char);
    for _ in 1..len {
        s.push(*rng.pick(REST) as char);
    }
    s
}

fn random_hex(rng: &mut Rng, n: usize) -> String {
    (0..n)
        .map(|_| *rng.pick(b"0123456789abcdef") as char)
        .collect()
}

fn made_up_path(rng: &mut Rng) -> String {
    match rng.below(8) {
        0 => "/".to_owned(),
        1 => format!("{ROOT}/session/{}", rng.pick(&U64S)),
        2 => format!("{ROOT}/region/{}", rng.pick(&U64S)),
        3 => format!("{ROOT}/qp/{}", rng.pick(&U64S)),
        4 => format!("{ROOT}/pool/{}", random_name_element(rng)),
        5 => format!("{ROOT}/device/{}", random_name_element(rng)),
        6 => "/org/rdmad1/session".to_owned(),
        _ => {
            let mut p = String::new();
            for _ in 0..rng.range(1, 5) {
                p.push('/');
                p.push_str(&random_name_element(rng));
            }
            p
        }
    }
}

fn basic_signature(rng: &mut Rng) -> Signature {
    rng.pick(&[
        Signature::U8,
        Signature::Bool,
        Signature::I16,
        Signature::U16,
        Signature::I32,
        Signature::U32,
        Signature::I64,
        Signature::U64,
        Signature::F64,
        Signature::Str,
        Signature::ObjectPath,
        Signature::Signature,
    ])
    .clone()
}

fn random_signature(rng: &mut Rng, depth: usize) -> Signature {
    if depth >= 3 || rng.chance(0.6) {
        return match rng.below(14) {
            0 => Signature::Variant,
            1 => Signature::Fd,
            _ => basic_signature(rng),
        };
    }
    match rng.below(4) {
        0 => Signature::array(random_signature(rng, depth + 1)),
        1 => {
            let key = match rng.below(3) {
                0 => Signature::U32,
                1 => Signature::U64,
                _ => Signature::Str,
            };
            let value = if rng.chance(0.5) {
                Signature::Variant
            } else {
                random_signature(rng, depth + 1)
            };
            Signature::dict(key, value)
        }
        2 => Signature::dict(Signature::Str, Signature::Variant),
        _ => {
            let n = rng.range(1, 4);
            Signature::structure(
                (0..n)
                    .map(|_| random_signature(rng, depth + 1))
                    .collect::<Vec<_>>(),
            )
        }
    }
}

/// A descriptor every call may borrow: `/dev/null`, opened once.
fn shared_fd() -> std::os::fd::BorrowedFd<'static> {
    use std::os::fd::AsFd;
    static NULL: std::sync::OnceLock<std::fs::File> = std::sync::OnceLock::new();
    NULL.get_or_init(|| std::fs::File::open("/dev/null").expect("open /dev/null"))
        .as_fd()
}

fn new_fd(rng: &mut Rng) -> Option<OwnedFd> {
    if rng.chance(0.5) {
        std::fs::File::open("/dev/null").ok().map(OwnedFd::from)
    } else {
        std::os::unix::net::UnixStream::pair()
            .ok()
            .map(|(a, _)| OwnedFd::from(a))
    }
}

impl Gen<'_> {
    fn seen_u64(&mut self) -> Option<u64> {
        self.known.numbers.pick(self.rng)
    }

    fn unsigned(&mut self) -> u64 {
        match self.rng.below(10) {
            0..=5 => *self.rng.pick(&U64S),
            6 | 7 => self.seen_u64().unwrap_or(1),
            8 => self.rng.next_u64() % 100_000,
            _ => self.rng.next_u64(),
        }
    }

    fn signed(&mut self) -> i64 {
        match self.rng.below(6) {
            0 => -1,
            1 => i64::MIN,
            2 => i64::MAX,
            3 => -(self.rng.below(5000) as i64),
            _ => self.unsigned() as i64,
        }
    }

    fn string(&mut self) -> String {
        match self.rng.below(12) {
            0 => String::new(),
            1 => self
                .known
                .names
                .pick(self.rng)
                .unwrap_or_else(|| "default".into()),
            2 => self
                .known
                .strings
                .pick(self.rng)
                .unwrap_or_else(|| "ro".into()),
            3 | 4 => (*self.rng.pick(&WORDS)).to_owned(),
            5 => {
                let n = self.rng.range(1, 40);
                (0..n).map(|_| random_char(self.rng)).collect()
            }
            6 => (*self.rng.pick(&PATHISH)).to_owned(),
            7 if self.budget > 8192 => {
                let n = if self.rng.chance(0.1) {
                    (1 << 20).min(self.budget)
                } else {
                    self.rng.range(4096, (256 << 10).min(self.budget))
                };
                self.budget -= n;
                let c = random_char(self.rng);
                let mut s: String = std::iter::repeat_n(c, n / c.len_utf8()).collect();
                if self.rng.chance(0.5) {
                    s.insert_str(0, "rdk1_");
                }
                s
            }
            8 => self.token(),
            9 => (*self.rng.pick(&[
                "-1",
                "0",
                "18446744073709551616",
                "0x1000",
                "1e9",
                " 4096 ",
                "NaN",
                "4KiB",
            ]))
            .to_owned(),
            _ => {
                let n = self.rng.range(0, 64);
                (0..n)
                    .map(|_| {
                        let b = self.rng.range(1, 0x7f) as u8;
                        b as char
                    })
                    .collect()
            }
        }
    }

    /// An access key: seen, well-formed but unknown, or almost well-formed.
    fn token(&mut self) -> String {
        if !self.known.live_tokens.is_empty() && self.rng.chance(0.5) {
            return self.rng.pick(&self.known.live_tokens).0.clone();
        }
        match self.rng.below(10) {
            0..=6 => match self.known.tokens.pick(self.rng) {
                Some(t) if self.rng.chance(0.85) => t,
                Some(t) => {
                    // One digit changed, or cut, or with a suffix.
                    let mut t = t;
                    match self.rng.below(3) {
                        0 => {
                            t.pop();
                            t.push('0');
                        }
                        1 => {
                            t.pop();
                        }
                        _ => t.push('f'),
                    }
                    t
                }
                None => format!("rdk1_{}", random_hex(self.rng, 64)),
            },
            7 => format!("rdk1_{}", random_hex(self.rng, 64)),
            8 => format!("rdk1_{}", random_hex(self.rng, 64).to_uppercase()),
            _ => {
                let n = self.rng.range(0, 70);
                format!("rdk1_{}", random_hex(self.rng, n))
            }
        }
    }

    fn object_path(&mut self) -> ObjectPath<'static> {
        let path = match self.rng.below(10) {
            0..=5 if !self.known.objects.is_empty() => {
                let i = self.rng.below(self.known.objects.len());
                self.known
                    .objects
                    .keys()
                    .nth(i)
                    .cloned()
                    .unwrap_or_else(|| ROOT.into())
            }
            6 | 7 => self
                .known
                .dead
                .pick(self.rng)
                .unwrap_or_else(|| made_up_path(self.rng)),
            _ => made_up_path(self.rng),
        };
        ObjectPath::try_from(path).unwrap_or_else(|_| ObjectPath::from_static_str_unchecked("/"))
    }

    fn path_with(&mut self, interface: &str) -> ObjectPath<'static> {
        let with = |own: bool| -> Vec<&String> {
            self.known
                .objects
                .iter()
                .filter(|(_, o)| o.interfaces.iter().any(|i| i == interface))
                .filter(|(_, o)| !own || o.owner.as_deref() == Some(self.me.as_str()))
                .map(|(p, _)| p)
                .collect()
        };
        let (own, all) = (with(true), with(false));
        let candidates = if !own.is_empty() && self.rng.chance(0.75) {
            own
        } else {
            all
        };
        if candidates.is_empty() || self.rng.chance(0.15) {
            return self.object_path();
        }
        let p = (*self.rng.pick(&candidates)).clone();
        ObjectPath::try_from(p).unwrap_or_else(|_| ObjectPath::from_static_str_unchecked("/"))
    }

    /// An id (of a key, of an export) this process was given: mostly one of the region
    /// being called (`of_region`), else any it saw.
    fn known_id(&mut self, of_region: &HashMap<String, Vec<u64>>, seen: &Seen<u64>) -> Option<u64> {
        if let Some(ids) = of_region.get(&self.path) {
            if self.rng.chance(0.7) {
                return Some(*self.rng.pick(ids));
            }
        }
        seen.pick(self.rng)
    }

    fn endpoint(&mut self) -> Value<'static> {
        let (gid, gi, qpn, psn, mtu, lid) = match self.known.endpoints.pick(self.rng) {
            Some(e) if self.rng.chance(0.75) => e,
            _ => (
                (*self.rng.pick(&[
                    "::ffff:127.0.0.1",
                    "::",
                    "fe80::1",
                    "not a gid",
                    "",
                    "::ffff:10.0.2.15",
                ]))
                .to_owned(),
                self.unsigned() as u32,
                self.unsigned() as u32,
                self.unsigned() as u32,
                *self
                    .rng
                    .pick(&[256, 512, 1024, 2048, 4096, 0, 4097, u32::MAX]),
                self.unsigned() as u16,
            ),
        };
        let mut fields = (gid, gi, qpn, psn, mtu, lid);
        if self.rng.chance(0.25) {
            match self.rng.below(6) {
                0 => fields.0 = self.string(),
                1 => fields.1 = self.unsigned() as u32,
                2 => fields.2 = self.unsigned() as u32,
                3 => fields.3 = self.unsigned() as u32,
                4 => fields.4 = self.unsigned() as u32,
                _ => fields.5 = self.unsigned() as u16,
            }
        }
        Value::Structure(
            StructureBuilder::new()
                .add_field(fields.0)
                .add_field(fields.1)
                .add_field(fields.2)
                .add_field(fields.3)
                .add_field(fields.4)
                .add_field(fields.5)
                .build()
                .expect("six fields"),
        )
    }

    /// A variant holding a value of `kind` (`s`, `t`, `u`), or of the wrong type.
    fn option_value(&mut self, key: &str, kind: char, right: bool) -> Value<'static> {
        let inner: Value<'static> = if right {
            match (key, kind) {
                ("access", _) if self.method == "Share" => {
                    Value::from(*self.rng.pick(&["ro", "rw", "ro", "rw", "", "RW", "r"]))
                }
                ("access", _) if self.method == "Register" => Value::from(
                    *self
                        .rng
                        .pick(&["l", "lrw", "lrwa", "r", "w", "la", "", "lx", "llll"]),
                ),
                ("access", _) => Value::from(
                    *self
                        .rng
                        .pick(&["rw", "r", "w", "a", "rwa", "", "rx", "wwww", "ro"]),
                ),
                (_, 't') => Value::from(*self.rng.pick(&[
                    0u64,
                    1,
                    4095,
                    4096,
                    65536,
                    u64::MAX,
                    u64::MAX - 4095,
                    1 << 47,
                ])),
                ("expires_in", _) => Value::from(*self.rng.pick(&[
                    0u64,
                    1,
                    3600,
                    86400,
                    u64::MAX,
                    1 << 34,
                    i64::MAX as u64,
                ])),
                (_, 'u') => {
                    let n = *self.rng.pick(&[0u64, 1, 2, 4, 5, 16, 64, 128, 1024, 65536]);
                    match self.rng.below(4) {
                        0 => Value::U64(if self.rng.chance(0.5) { n } else { u64::MAX }),
                        1 => Value::U32(u32::MAX),
                        _ => Value::U32(n as u32),
                    }
                }
                _ => Value::from(self.string()),
            }
        } else {
            let sig = random_signature(self.rng, 2);
            self.random_value(&sig, 2)
        };
        Value::Value(Box::new(inner))
    }

    fn options(&mut self) -> Value<'static> {
        let mut dict = Dict::new(&Signature::Str, &Signature::Variant);
        let known: &[(&str, char)] = OPTIONS
            .iter()
            .find(|(m, _)| *m == self.method)
            .map_or(&[], |(_, o)| o);
        match self.rng.below(20) {
            // Empty: the usual call, to get deep.
            0..=9 => {}
            // The documented options with the right types.
            10..=16 => {
                for (key, kind) in known {
                    if self.rng.chance(0.6) {
                        let v = self.option_value(key, *kind, true);
                        let _ = dict.append(Value::from(*key), v);
                    }
                }
            }
            // Wrong types, unknown names, other methods' options.
            _ => {
                for _ in 0..self.rng.range(1, 4) {
                    let key: String = match self.rng.below(4) {
                        0 => (*self.rng.pick(&ALL_OPTION_NAMES)).to_owned(),
                        1 if !known.is_empty() => self.rng.pick(known).0.to_owned(),
                        2 => self.string(),
                        _ => random_name_element(self.rng),
                    };
                    let right = self.rng.chance(0.3);
                    let v = self.option_value(&key, 'u', right);
                    let _ = dict.append(Value::from(key), v);
                }
            }
        }
        Value::Dict(dict)
    }

    /// A well-typed value for argument `name` of type `sig`.
    fn arg(&mut self, name: &str, sig: &Signature) -> Value<'static> {
        let biased = self.rng.chance(0.8);
        match (name, sig) {
            ("options", Signature::Dict { .. }) => return self.options(),
            ("key", Signature::Str) if biased || self.rng.chance(0.5) => {
                return Value::from(self.token())
            }
            ("pool" | "device" | "name", Signature::Str) if biased => {
                let seen = if name == "pool" {
                    &self.known.pools
                } else {
                    &self.known.devices
                };
                if let Some(n) = seen.pick(self.rng).filter(|_| self.rng.chance(0.85)) {
                    return Value::from(n);
                }
                if let Some(n) = self
                    .known
                    .names
                    .pick(self.rng)
                    .filter(|_| self.rng.chance(0.5))
                {
                    return Value::from(n);
                }
                return Value::from(*self.rng.pick(&[
                    "fuzz",
                    "fine",
                    "witness",
                    "loopback0",
                    "nope",
                    "",
                ]));
            }
            ("size", Signature::U64) if biased => {
                return Value::U64(if self.rng.chance(0.8) {
                    *self.rng.pick(&SIZES)
                } else {
                    self.rng.next_u64() % (2 << 20)
                })
            }
            ("key_id", Signature::U64) if biased => {
                let known = self.known;
                if let Some(id) = self.known_id(&known.region_keys, &known.key_ids) {
                    return Value::U64(id);
                }
            }
            ("export_id", Signature::U64) if biased => {
                let known = self.known;
                if let Some(id) = self.known_id(&known.region_exports, &known.export_ids) {
                    return Value::U64(id);
                }
            }
            ("uid", Signature::U32) if biased => {
                return Value::U32(*self.rng.pick(&[0, 1, 65534, u32::MAX, 1000, 4242]));
            }
            ("qp", Signature::ObjectPath) if biased => {
                let connected: Vec<&String> = self
                    .known
                    .connected
                    .iter()
                    .filter(|p| {
                        self.known
                            .objects
                            .get(*p)
                            .is_some_and(|o| o.owner.as_deref() == Some(self.me.as_str()))
                    })
                    .collect();
                if !connected.is_empty() && self.rng.chance(0.6) {
                    let p = (*self.rng.pick(&connected)).clone();
                    if let Ok(p) = ObjectPath::try_from(p) {
                        return Value::ObjectPath(p);
                    }
                }
                return Value::ObjectPath(self.path_with("org.rdmad1.QueuePair"));
            }
            ("remote", Signature::Structure(_)) if biased => return self.endpoint(),
            ("interface_name", Signature::Str) => {
                let iface = match self.rng.below(10) {
                    0..=6 if !self.object_interfaces.is_empty() => {
                        self.rng.pick(&self.object_interfaces).clone()
                    }
                    7 => self
                        .known
                        .interfaces
                        .keys()
                        .nth(self.rng.below(self.known.interfaces.len().max(1)))
                        .cloned()
                        .unwrap_or_default(),
                    8 => format!("org.rdmad1.{}", random_name_element(self.rng)),
                    _ => self.string(),
                };
                self.prop_iface = Some(iface.clone());
                return Value::from(iface);
            }
            ("property_name", Signature::Str) => {
                let props: Vec<String> = self
                    .prop_iface
                    .as_ref()
                    .and_then(|i| self.known.interfaces.get(i))
                    .map(|i| i.properties.iter().map(|p| p.0.clone()).collect())
                    .unwrap_or_default();
                if !props.is_empty() && self.rng.chance(0.75) {
                    return Value::from(self.rng.pick(&props).clone());
                }
                return Value::from(if self.rng.chance(0.5) {
                    random_name_element(self.rng)
                } else {
                    self.string()
                });
            }
            ("value", Signature::Variant) => {
                let ty = self
                    .prop_iface
                    .as_ref()
                    .and_then(|i| self.known.interfaces.get(i))
                    .and_then(|i| {
                        (!i.properties.is_empty())
                            .then(|| i.properties[self.rng.below(i.properties.len())].1.clone())
                    });
                if let Some(ty) = ty.filter(|_| self.rng.chance(0.5)) {
                    return Value::Value(Box::new(self.random_value(&ty, 1)));
                }
            }
            _ => {}
        }
        self.random_value(sig, 0)
    }

    /// A value of type `sig`, biased to the interesting ones.
    fn random_value(&mut self, sig: &Signature, depth: usize) -> Value<'static> {
        match sig {
            Signature::U8 => Value::U8(*self.rng.pick(&[0, 1, 0x7f, 0x80, 0xff])),
            Signature::Bool => Value::Bool(self.rng.chance(0.5)),
            Signature::I16 => Value::I16(self.signed() as i16),
            Signature::U16 => Value::U16(self.unsigned() as u16),
            Signature::I32 => Value::I32(self.signed() as i32),
            Signature::U32 => Value::U32(self.unsigned() as u32),
            Signature::I64 => Value::I64(self.signed()),
            Signature::U64 => Value::U64(self.unsigned()),
            Signature::F64 => {
                Value::F64(
                    *self
                        .rng
                        .pick(&[0.0, -1.5, f64::NAN, f64::INFINITY, f64::MAX, 4096.0]),
                )
            }
            Signature::Str => Value::from(self.string()),
            Signature::Signature => Value::Signature(random_signature(self.rng, 1)),
            Signature::ObjectPath => Value::ObjectPath(self.object_path()),
            Signature::Variant => {
                let inner = if depth >= 4 {
                    basic_signature(self.rng)
                } else {
                    random_signature(self.rng, depth + 1)
                };
                Value::Value(Box::new(self.random_value(&inner, depth + 1)))
            }
            Signature::Fd => {
                // A few new descriptors per call, then one shared (the bus refuses messages
                // with many, and the kernel more than 253).
                let fresh = if self.fds_left > 0 {
                    new_fd(self.rng)
                } else {
                    None
                };
                match fresh {
                    Some(fd) => {
                        self.fds_left -= 1;
                        Value::Fd(Fd::from(fd))
                    }
                    None => Value::Fd(Fd::from(shared_fd())),
                }
            }
            Signature::Array(child) => {
                let child = child.signature();
                let mut array = Array::new(child);
                let n = match self.rng.below(10) {
                    0..=2 => 0,
                    3..=8 => self.rng.range(1, 3),
                    _ if depth < 2 && matches!(child, Signature::U8 | Signature::U64) => {
                        self.rng.range(16, 512)
                    }
                    _ => self.rng.range(4, 12),
                };
                for _ in 0..n {
                    let v = self.random_value(child, depth + 1);
                    let _ = array.append(v);
                }
                Value::Array(array)
            }
            Signature::Dict { key, value } => {
                let (key, value) = (key.signature(), value.signature());
                let mut dict = Dict::new(key, value);
                for _ in 0..self.rng.range(0, 3) {
                    let k = self.random_value(key, depth + 1);
                    let v = self.random_value(value, depth + 1);
                    let _ = dict.append(k, v);
                }
                Value::Dict(dict)
            }
            Signature::Structure(fields) => {
                let mut b = StructureBuilder::new();
                for f in fields.iter() {
                    b = b.append_field(self.random_value(f, depth + 1));
                }
                b.build().map_or(Value::U8(0), Value::Structure)
            }
            _ => Value::U8(0),
        }
    }
}

// ---------------------------------------------------------------------------------------
// Calls

/// One call to make.
struct Plan {
    path: String,
    interface: Option<String>,
    member: String,
    args: Vec<Value<'static>>,
    label: String,
    ill_typed: bool,
    /// The introspected reply signature, when the call is the real method's.
    outputs: Option<String>,
}

fn interface_weight(name: &str) -> f64 {
    match name {
        "org.rdmad1.Manager" => 3.0,
        "org.rdmad1.Session" | "org.rdmad1.Region" => 4.0,
        "org.rdmad1.QueuePair" => 3.0,
        "org.rdmad1.Device" | "org.rdmad1.Pool" => 1.0,
        PROPERTIES => 3.0,
        INTROSPECTABLE => 0.7,
        OBJECT_MANAGER => 0.5,
        "org.freedesktop.DBus.Peer" => 0.3,
        _ => 1.0,
    }
}

fn method_weight(interface: &str, method: &str) -> f64 {
    match (interface, method) {
        (_, "OpenSession") => 6.0,
        (_, "AllocateRegion") => 5.0,
        (_, "AttachRegion" | "CreateQueuePair" | "Share" | "Connect" | "ExportRemote") => 3.0,
        (_, "Endpoint") => 2.0,
        ("org.rdmad1.Session", "Close") => 1.2,
        (_, "Reload") => 0.2,
        _ => 1.0,
    }
}

/// Descriptors in a value (each occurrence counts: the bus counts them so).
fn count_fds(v: &Value<'_>) -> usize {
    match v {
        Value::Fd(_) => 1,
        Value::Value(inner) => count_fds(inner),
        Value::Array(a) => a.inner().iter().map(count_fds).sum(),
        Value::Dict(d) => d.iter().map(|(k, v)| count_fds(k) + count_fds(v)).sum(),
        Value::Structure(s) => s.fields().iter().map(count_fds).sum(),
        _ => 0,
    }
}

/// The most descriptors a message may carry: the system bus's `max_message_unix_fds` is
/// 16, and it disconnects a sender that passes more.
const MAX_FDS_PER_MESSAGE: usize = 16;

/// The arguments, with those carrying too many descriptors in all replaced: a variant by a
/// variant holding a `u` (so the call stays well-typed), anything else by a `u` (and then
/// the call is ill-typed: the second result says so).
fn within_fd_limit(mut args: Vec<Value<'static>>) -> (Vec<Value<'static>>, bool) {
    let mut total = 0;
    let mut retyped = false;
    for a in &mut args {
        let n = count_fds(a);
        if total + n > MAX_FDS_PER_MESSAGE {
            if matches!(a, Value::Value(_)) {
                *a = Value::Value(Box::new(Value::U32(0)));
            } else {
                *a = Value::U32(0);
                retyped = true;
            }
        } else {
            total += n;
        }
    }
    (args, retyped)
}

/// The body of a call: its arguments as the fields of a structure (whose outer parentheses
/// zbus leaves out of the message's signature), or nothing.
fn encode(args: Vec<Value<'static>>) -> Option<Structure<'static>> {
    if args.is_empty() {
        return None;
    }
    let mut b = StructureBuilder::new();
    for a in args {
        b = b.append_field(a);
    }
    b.build().ok()
}

fn signature_of(args: &[Value<'_>]) -> String {
    args.iter()
        .map(|a| a.value_signature().to_string())
        .collect()
}

/// The reply body as a list of values.
fn reply_fields(msg: &zbus::Message) -> Result<Vec<Value<'static>>, String> {
    let body = msg.body();
    let sig = body.signature().clone();
    let as_struct = match &sig {
        Signature::Unit => return Ok(Vec::new()),
        Signature::Structure(_) => sig.clone(),
        other => Signature::structure([other.clone()]),
    };
    let (s, _): (Structure<'_>, _) = body
        .data()
        .deserialize_for_dynamic_signature(&as_struct)
        .map_err(|e| format!("cannot read a reply of signature {sig}: {e}"))?;
    // Descriptors in the reply are closed with the message; keep none.
    let fields = s
        .into_fields()
        .into_iter()
        .map(|f| f.try_to_owned().map(Value::from).unwrap_or(Value::U8(0)))
        .collect();
    Ok(fields)
}

/// The normalized form of a signature string: parsed and printed without outer parens.
fn normalized(sig: &str) -> String {
    Signature::from_str(sig).map_or_else(|_| sig.to_owned(), |s| s.to_string_no_parens())
}

struct Slot {
    connection: Connection,
    generation: u64,
}

struct Shared {
    known: Mutex<Known>,
    slots: Vec<Mutex<Slot>>,
    remaining: AtomicI64,
    made: AtomicU64,
    failed: AtomicBool,
    args: Args,
    my_uid: u32,
}

async fn connect(address: &str) -> zbus::Result<Connection> {
    zbus::connection::Builder::address(address)?.build().await
}

/// A connection to call on: to the bus, or with `--direct` a direct one to rdmad opened
/// over a bus connection made for it.
async fn connect_for_calls(args: &Args) -> Result<Connection, String> {
    let bus = connect(&args.bus).await.map_err(|e| e.to_string())?;
    if !args.direct {
        return Ok(bus);
    }
    rdmad_client::connect_direct(&bus)
        .await
        .map_err(|e| format!("cannot open a direct connection: {e}"))
}

enum Outcome {
    Ok(Vec<Value<'static>>, String),
    Error(String, String),
    /// Our own connection was closed under the call.
    Aborted,
    Unsendable,
    Failure(String),
}

async fn send(shared: &Shared, slot: usize, plan: &Plan) -> Outcome {
    let (connection, generation) = {
        let s = shared.slots[slot].lock().expect("slot lock");
        (s.connection.clone(), s.generation)
    };
    let interface = plan.interface.as_deref();
    let args = plan
        .args
        .iter()
        .map(|a| a.try_clone())
        .collect::<Result<Vec<_>, _>>();
    let Ok(args) = args else {
        return Outcome::Unsendable;
    };
    let body = encode(args);
    let call = async {
        match &body {
            Some(b) => {
                connection
                    .call_method(
                        Some(BUS_NAME),
                        plan.path.as_str(),
                        interface,
                        plan.member.as_str(),
                        b,
                    )
                    .await
            }
            None => {
                connection
                    .call_method(
                        Some(BUS_NAME),
                        plan.path.as_str(),
                        interface,
                        plan.member.as_str(),
                        &(),
                    )
                    .await
            }
        }
    };
    let result = match tokio::time::timeout(shared.args.timeout, call).await {
        Ok(r) => r,
        Err(_) => {
            return Outcome::Failure(format!(
                "no reply within {:?} to {} on {} ({})",
                shared.args.timeout,
                plan.label,
                plan.path,
                signature_of(&plan.args)
            ))
        }
    };
    let reconnected = || shared.slots[slot].lock().expect("slot lock").generation != generation;
    match result {
        Ok(msg) => match reply_fields(&msg) {
            Ok(fields) => Outcome::Ok(fields, msg.body().signature().to_string_no_parens()),
            Err(e) => Outcome::Error("(unreadable reply)".into(), e),
        },
        Err(zbus::Error::MethodError(name, message, _)) => {
            Outcome::Error(name.to_string(), message.unwrap_or_default())
        }
        Err(zbus::Error::InputOutput(_)) if reconnected() => Outcome::Aborted,
        Err(_) if connection.is_closed() && reconnected() => Outcome::Aborted,
        Err(
            zbus::Error::Variant(_)
            | zbus::Error::ExcessData
            | zbus::Error::InvalidField
            | zbus::Error::Names(_),
        ) => Outcome::Unsendable,
        Err(e) => Outcome::Failure(format!(
            "{} on {} ({}): {e}",
            plan.label,
            plan.path,
            signature_of(&plan.args)
        )),
    }
}

/// Plans the next call. `me` is the unique name of the connection it will go on.
fn plan(known: &Known, rng: &mut Rng, me: &str) -> Plan {
    // Made-up paths, interfaces and methods, and calls without an interface.
    if rng.chance(0.04) || known.objects.is_empty() {
        let mut g = Gen {
            known,
            rng,
            method: String::new(),
            object_interfaces: Vec::new(),
            path: String::new(),
            prop_iface: None,
            me: me.to_owned(),
            budget: 64 << 10,
            fds_left: 4,
        };
        let args: Vec<Value<'static>> = (0..g.rng.range(0, 3))
            .map(|_| {
                let sig = random_signature(g.rng, 1);
                g.random_value(&sig, 1)
            })
            .collect();
        let real_path = g.object_path().to_string();
        let real_iface: Vec<&String> = known.interfaces.keys().collect();
        let real_method = |rng: &mut Rng| {
            let iface = known
                .interfaces
                .values()
                .nth(rng.below(known.interfaces.len().max(1)));
            iface
                .filter(|i| !i.methods.is_empty())
                .map(|i| rng.pick(&i.methods).name.clone())
                .unwrap_or_else(|| "Close".into())
        };
        let (path, interface, member, label) = match rng.below(4) {
            0 => (
                made_up_path(rng),
                real_iface
                    .get(rng.below(real_iface.len().max(1)))
                    .map(|s| s.to_string()),
                real_method(rng),
                "(made-up path)",
            ),
            1 => (
                real_path,
                Some(match rng.below(3) {
                    0 => "org.rdmad1.Nope".to_owned(),
                    1 => "org.rdmad2.Manager".to_owned(),
                    _ => format!("{}.{}", random_name_element(rng), random_name_element(rng)),
                }),
                real_method(rng),
                "(made-up interface)",
            ),
            2 => {
                let iface = known
                    .objects
                    .get(&real_path)
                    .and_then(|o| o.interfaces.first().cloned());
                let member = if rng.chance(0.5) {
                    real_method(rng)
                } else {
                    rng.pick(&["Frobnicate", "open_session", "OPENSESSION", "Get", "Free"])
                        .to_string()
                };
                (real_path, iface, member, "(made-up method)")
            }
            _ => (real_path, None, real_method(rng), "(no interface)"),
        };
        return Plan {
            path,
            interface,
            member,
            args: within_fd_limit(args).0,
            label: label.to_owned(),
            ill_typed: true,
            outputs: None,
        };
    }

    // An interface some object has, then an object with it, then a method.
    let mut present: Vec<&String> = known
        .interfaces
        .keys()
        .filter(|i| {
            known.objects.values().any(|o| o.interfaces.contains(i))
                && !known.interfaces[*i].methods.is_empty()
        })
        .collect();
    present.sort();
    let weights: Vec<f64> = present.iter().map(|i| interface_weight(i)).collect();
    let iface_name = present[rng.weighted(&weights)].clone();
    let iface = &known.interfaces[&iface_name];
    let with: Vec<(&String, &Object)> = known
        .objects
        .iter()
        .filter(|(_, o)| o.interfaces.contains(&iface_name))
        .collect();
    let own: Vec<&(&String, &Object)> = with
        .iter()
        .filter(|(_, o)| o.owner.as_deref() == Some(me))
        .collect();
    // An export needs a region and a connected queue pair of one connection, a state the
    // fuzzer reaches rarely: while it lasts, exports are tried more often.
    let exportable = iface_name == "org.rdmad1.Region"
        && !own.is_empty()
        && known.connected.iter().any(|qp| {
            known
                .objects
                .get(qp)
                .is_some_and(|o| o.owner.as_deref() == Some(me))
        });
    let connectable = iface_name == "org.rdmad1.QueuePair"
        && own.iter().any(|(p, _)| !known.connected.contains(*p));
    let weights: Vec<f64> = iface
        .methods
        .iter()
        .map(|m| {
            let boost = match m.name.as_str() {
                "ExportRemote" if exportable => 8.0,
                "Connect" if connectable => 3.0,
                _ => 1.0,
            };
            method_weight(&iface_name, &m.name) * boost
        })
        .collect();
    let method = iface.methods[rng.weighted(&weights)].clone();
    // Objects on which the method can succeed: attachments to detach, queue pairs not
    // connected yet.
    let promising: Vec<&(&String, &Object)> = match (iface_name.as_str(), method.name.as_str()) {
        ("org.rdmad1.Region", "Detach") => own
            .iter()
            .copied()
            .filter(|(p, _)| known.attached.contains(*p))
            .collect(),
        ("org.rdmad1.QueuePair", "Connect") => own
            .iter()
            .copied()
            .filter(|(p, _)| !known.connected.contains(*p))
            .collect(),
        ("org.rdmad1.Region", "ReleaseExport") => own
            .iter()
            .copied()
            .filter(|(p, _)| known.region_exports.contains_key(*p))
            .collect(),
        ("org.rdmad1.Region", "RevokeKey") => own
            .iter()
            .copied()
            .filter(|(p, _)| known.region_keys.contains_key(*p))
            .collect(),
        _ => Vec::new(),
    };
    let (path, object) = if !promising.is_empty() && rng.chance(0.6) {
        **rng.pick(&promising)
    } else if !own.is_empty() && rng.chance(0.7) {
        **rng.pick(&own)
    } else {
        *rng.pick(&with)
    };
    let mut path = path.clone();
    if rng.chance(0.05) {
        // An object of the same kind that is gone.
        let parent = Known::parent(&path);
        let dead: Vec<&String> = known
            .dead
            .items
            .iter()
            .filter(|d| Known::parent(d) == parent)
            .collect();
        if !dead.is_empty() {
            path = (*rng.pick(&dead)).clone();
        }
    }
    let mut g = Gen {
        known,
        rng,
        method: method.name.clone(),
        object_interfaces: object.interfaces.clone(),
        path: path.clone(),
        prop_iface: None,
        me: me.to_owned(),
        budget: 2 << 20,
        fds_left: 4,
    };
    let mut args: Vec<Value<'static>> = method
        .inputs
        .iter()
        .map(|(name, sig)| g.arg(name, sig))
        .collect();
    let ill_typed = g.rng.chance(0.3);
    if ill_typed {
        match g.rng.below(4) {
            0 => {
                args = (0..g.rng.range(0, 4))
                    .map(|_| {
                        let sig = random_signature(g.rng, 0);
                        g.random_value(&sig, 0)
                    })
                    .collect();
            }
            1 if !args.is_empty() => {
                let i = g.rng.below(args.len());
                args.remove(i);
            }
            2 => {
                let sig = random_signature(g.rng, 0);
                let v = g.random_value(&sig, 0);
                let i = g.rng.below(args.len() + 1);
                args.insert(i, v);
            }
            _ if !args.is_empty() => {
                let i = g.rng.below(args.len());
                let sig = random_signature(g.rng, 0);
                args[i] = g.random_value(&sig, 0);
            }
            _ => {
                let sig = random_signature(g.rng, 0);
                args.push(g.random_value(&sig, 0));
            }
        }
    }
    let (args, retyped) = within_fd_limit(args);
    Plan {
        path,
        label: format!("{iface_name}.{}", method.name),
        interface: Some(iface_name),
        member: method.name,
        args,
        ill_typed: ill_typed || retyped,
        outputs: Some(method.outputs),
    }
}

/// Introspects `path` and learns what it says; returns whether it answered.
async fn introspect(shared: &Shared, slot: usize, path: &str) -> bool {
    let plan = Plan {
        path: path.to_owned(),
        interface: Some(INTROSPECTABLE.to_owned()),
        member: "Introspect".to_owned(),
        args: Vec::new(),
        label: format!("{INTROSPECTABLE}.Introspect"),
        ill_typed: false,
        outputs: Some("s".into()),
    };
    record(shared, slot, &plan, send(shared, slot, &plan).await)
}

/// Whether an `org.freedesktop.zbus.Error` reply is zbus refusing arguments it could not
/// decode, before any rdmad code ran: zbus (5.x) answers a call whose signature is not the
/// method's with `org.freedesktop.zbus.Error` "Signature mismatch" rather than
/// `org.freedesktop.DBus.Error.InvalidArgs`, and its own `Properties` interface answers an
/// invalid interface name the same way. Tolerated, counted and reported; the same error on a
/// call with the right signature to one of rdmad's methods stays a finding.
fn zbus_decode_refusal(plan: &Plan, message: &str) -> bool {
    let wrong_signature = match (&plan.outputs, plan.ill_typed) {
        (_, true) => true,
        (None, false) => true,
        (Some(_), false) => false,
    };
    (message.starts_with("Signature mismatch") && wrong_signature)
        || (plan.interface.as_deref() == Some(PROPERTIES)
            && message.starts_with("Invalid interface name"))
}

/// Counts and checks one outcome; learns from a success. Returns whether it succeeded.
fn record(shared: &Shared, slot: usize, plan: &Plan, outcome: Outcome) -> bool {
    shared.remaining.fetch_sub(1, Ordering::Relaxed);
    shared.made.fetch_add(1, Ordering::Relaxed);
    let me = shared.slots[slot]
        .lock()
        .expect("slot lock")
        .connection
        .unique_name()
        .map(|n| n.to_string())
        .unwrap_or_default();
    if shared.args.verbose {
        let what = match &outcome {
            Outcome::Ok(_, sig) => format!("ok ({sig})"),
            Outcome::Error(name, message) => format!("{name}: {message}"),
            Outcome::Aborted => "aborted".into(),
            Outcome::Unsendable => "not sendable".into(),
            Outcome::Failure(f) => format!("FAILURE {f}"),
        };
        let what: String = what.chars().take(300).collect();
        println!(
            "{} {} {:?} ({}): {what}",
            plan.label,
            plan.path,
            plan.interface,
            signature_of(&plan.args)
                .chars()
                .take(80)
                .collect::<String>()
        );
    }
    let mut known = shared.known.lock().expect("known lock");
    let describe = || {
        format!(
            "{} on {} with ({}){}",
            plan.label,
            plan.path,
            signature_of(&plan.args),
            if plan.ill_typed { " [ill-typed]" } else { "" }
        )
    };
    match outcome {
        Outcome::Ok(fields, sig) => {
            let stats = known.stats(&plan.label);
            stats.calls += 1;
            stats.ok += 1;
            if plan.ill_typed {
                stats.ill_typed += 1;
            }
            if let Some(out) = plan.outputs.as_deref().filter(|_| !plan.ill_typed) {
                if normalized(out) != sig {
                    let finding = format!(
                        "{}: replied with signature {sig:?}, introspection says {out:?}",
                        describe()
                    );
                    known.findings.push(finding);
                }
            }
            if plan.label == format!("{INTROSPECTABLE}.Introspect") {
                if let Some(Value::Str(xml)) = fields.first() {
                    let data = parse_introspection(xml.as_str());
                    known.learn(&plan.path, data);
                }
            } else if plan.label == format!("{OBJECT_MANAGER}.GetManagedObjects") {
                if let Some(Value::Dict(objects)) = fields.first() {
                    for (path, ifaces) in objects.iter() {
                        let (Value::ObjectPath(p), Value::Dict(ifaces)) = (path, ifaces) else {
                            continue;
                        };
                        let names: Vec<String> = ifaces
                            .iter()
                            .filter_map(|(k, _)| match k {
                                Value::Str(s) => Some(s.to_string()),
                                _ => None,
                            })
                            .collect();
                        known.add_path(p.as_str(), None);
                        if let Some(o) = known.objects.get_mut(p.as_str()) {
                            for n in names {
                                if !o.interfaces.contains(&n) {
                                    o.interfaces.push(n);
                                }
                            }
                        }
                    }
                }
            }
            known.harvest(&plan.label, &plan.path, &me, &fields);
            if std::env::var("FUZZ_DEBUG").is_ok()
                && known
                    .objects
                    .get(ROOT)
                    .is_some_and(|o| o.interfaces.iter().any(|i| i == "org.rdmad1.Region"))
            {
                eprintln!(
                    "DEBUG root became a region after {} on {}: {:?}",
                    plan.label, plan.path, fields
                );
                std::process::exit(9);
            }
            true
        }
        Outcome::Error(name, message) => {
            let stats = known.stats(&plan.label);
            stats.calls += 1;
            if plan.ill_typed {
                stats.ill_typed += 1;
            }
            *stats.errors.entry(name.clone()).or_default() += 1;
            if name == "org.freedesktop.DBus.Error.UnknownObject" {
                known.bury(&plan.path);
            }
            if FAILURES.contains(&name.as_str()) {
                known
                    .failures
                    .push(format!("{}: {name}: {message}", describe()));
                shared.failed.store(true, Ordering::Relaxed);
            } else if let Some(short) = name.strip_prefix("org.rdmad1.Error.") {
                if !RDMAD_ERRORS.contains(&short) {
                    let f = format!("{}: undocumented error {name}: {message}", describe());
                    known.findings.push(f);
                } else if message.trim().is_empty() {
                    let f = format!("{}: {name} without a message", describe());
                    known.findings.push(f);
                }
            } else if name == "org.freedesktop.zbus.Error" && zbus_decode_refusal(plan, &message) {
                // zbus's own reply to arguments it cannot decode (see zbus_decode_refusal).
                known.zbus_refusals += 1;
            } else if !name.starts_with("org.freedesktop.DBus.Error.") {
                let f = format!("{}: error {name}: {message}", describe());
                known.findings.push(f);
            }
            false
        }
        Outcome::Aborted => {
            known.aborted += 1;
            false
        }
        Outcome::Unsendable => {
            known.unsendable += 1;
            false
        }
        Outcome::Failure(f) => {
            known.failures.push(f);
            shared.failed.store(true, Ordering::Relaxed);
            false
        }
    }
}

/// Before closing a session this process did not open: whether its user is spared.
async fn spared(shared: &Shared, slot: usize, plan: &Plan, me: &str) -> bool {
    if shared.args.spare_uids.is_empty() || plan.member != "Close" {
        return false;
    }
    let (is_session, own, uid) = {
        let known = shared.known.lock().expect("known lock");
        let object = known.objects.get(&plan.path);
        (
            object.is_some_and(|o| o.interfaces.iter().any(|i| i == SESSION))
                || plan.path.starts_with("/org/rdmad1/session/"),
            object.is_some_and(|o| o.owner.as_deref() == Some(me)),
            known.session_uids.get(&plan.path).copied(),
        )
    };
    if !is_session || own {
        return false;
    }
    let uid = match uid {
        Some(uid) => uid,
        None => {
            let info = Plan {
                path: plan.path.clone(),
                interface: Some(SESSION.to_owned()),
                member: "GetInfo".to_owned(),
                args: Vec::new(),
                label: format!("{SESSION}.GetInfo"),
                ill_typed: false,
                outputs: None,
            };
            let outcome = send(shared, slot, &info).await;
            let uid = match &outcome {
                Outcome::Ok(fields, _) => match fields.get(2) {
                    Some(Value::U32(uid)) => Some(*uid),
                    _ => None,
                },
                _ => None,
            };
            record(shared, slot, &info, outcome);
            match uid {
                Some(uid) => uid,
                // Not visible to us (so not closable by us either), or gone.
                None => return false,
            }
        }
    };
    shared.args.spare_uids.contains(&uid)
}

async fn worker(shared: Arc<Shared>, index: usize, seed: u64) {
    let mut rng = seeded(seed);
    let slot = index % shared.slots.len();
    while shared.remaining.load(Ordering::Relaxed) > 0 && !shared.failed.load(Ordering::Relaxed) {
        // Now and then, replace the connection while the others use it.
        if rng.chance(0.002) {
            let fresh = match connect_for_calls(&shared.args).await {
                Ok(c) => c,
                Err(e) => {
                    let mut known = shared.known.lock().expect("known lock");
                    known.failures.push(format!("cannot reconnect: {e}"));
                    shared.failed.store(true, Ordering::Relaxed);
                    return;
                }
            };
            let old = {
                let mut s = shared.slots[slot].lock().expect("slot lock");
                s.generation += 1;
                std::mem::replace(&mut s.connection, fresh)
            };
            let _ = old.close().await;
            continue;
        }
        let me = shared.slots[slot]
            .lock()
            .expect("slot lock")
            .connection
            .unique_name()
            .map(|n| n.to_string())
            .unwrap_or_default();
        let plan = {
            let known = shared.known.lock().expect("known lock");
            plan(&known, &mut rng, &me)
        };
        if spared(&shared, slot, &plan, &me).await {
            shared.known.lock().expect("known lock").spared += 1;
            continue;
        }
        let outcome = send(&shared, slot, &plan).await;
        record(&shared, slot, &plan, outcome);
        // Learn the interfaces of objects nobody introspected yet.
        let unknown: Vec<String> = {
            let known = shared.known.lock().expect("known lock");
            known
                .objects
                .iter()
                .filter(|(_, o)| o.interfaces.is_empty())
                .map(|(p, _)| p.clone())
                .take(4)
                .collect()
        };
        for path in unknown {
            if !introspect(&shared, slot, &path).await {
                shared.known.lock().expect("known lock").bury(&path);
            }
        }
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args = parse_args();
    println!(
        "rdmad-fuzz-dbus: seed {} ({} calls, {} workers on {} connections)",
        args.seed, args.calls, args.workers, args.connections
    );
    let mut slots = Vec::new();
    for _ in 0..args.connections {
        match connect_for_calls(&args).await {
            Ok(connection) => slots.push(Mutex::new(Slot {
                connection,
                generation: 0,
            })),
            Err(e) => {
                eprintln!("rdmad-fuzz-dbus: cannot connect to {}: {e}", args.bus);
                std::process::exit(3);
            }
        }
    }
    let shared = Arc::new(Shared {
        known: Mutex::new(Known::new(args.seed)),
        slots,
        remaining: AtomicI64::new(i64::try_from(args.calls).unwrap_or(i64::MAX)),
        made: AtomicU64::new(0),
        failed: AtomicBool::new(false),
        my_uid: nix::unistd::getuid().as_raw(),
        args,
    });
    let started = Instant::now();

    // Discovery: every node from the root down, and the ObjectManager's view.
    let mut queue = vec![ROOT.to_owned()];
    let mut visited = HashSet::new();
    while let Some(path) = queue.pop() {
        if !visited.insert(path.clone()) {
            continue;
        }
        introspect(&shared, 0, &path).await;
        let known = shared.known.lock().expect("known lock");
        queue.extend(
            known
                .objects
                .keys()
                .filter(|p| !visited.contains(*p))
                .cloned(),
        );
    }
    let managed = Plan {
        path: ROOT.to_owned(),
        interface: Some(OBJECT_MANAGER.to_owned()),
        member: "GetManagedObjects".to_owned(),
        args: Vec::new(),
        label: format!("{OBJECT_MANAGER}.GetManagedObjects"),
        ill_typed: false,
        outputs: Some("a{oa{sa{sv}}}".into()),
    };
    let outcome = send(&shared, 0, &managed).await;
    record(&shared, 0, &managed, outcome);
    {
        let known = shared.known.lock().expect("known lock");
        let rdmad: Vec<&String> = known
            .interfaces
            .keys()
            .filter(|i| i.starts_with("org.rdmad1."))
            .collect();
        if !shared.args.quiet {
            println!(
                "discovered {} objects, interfaces {:?} (uid {})",
                known.objects.len(),
                rdmad,
                shared.my_uid
            );
        }
        if rdmad.is_empty() {
            eprintln!("rdmad-fuzz-dbus: no org.rdmad1 interface found: is rdmad on this bus?");
            std::process::exit(2);
        }
    }

    let mut seeder = seeded(shared.args.seed);
    let tasks: Vec<_> = (0..shared.args.workers)
        .map(|i| tokio::spawn(worker(Arc::clone(&shared), i, seeder.next_u64())))
        .collect();
    for t in tasks {
        if let Err(e) = t.await {
            eprintln!("rdmad-fuzz-dbus: a worker panicked: {e}");
            shared.failed.store(true, Ordering::Relaxed);
        }
    }
    let elapsed = started.elapsed().as_secs_f64();
    if shared.failed.load(Ordering::Relaxed) {
        // Tell a daemon that died or left from a connection the bus dropped.
        let still_there = match connect(&shared.args.bus).await {
            Ok(c) => match zbus::fdo::DBusProxy::new(&c).await {
                Ok(dbus) => match BUS_NAME.try_into() {
                    Ok(name) => dbus.name_has_owner(name).await.ok(),
                    Err(_) => None,
                },
                Err(_) => None,
            },
            Err(_) => None,
        };
        let note = match still_there {
            Some(true) => "after the failures rdmad still owns org.rdmad1 on the bus",
            Some(false) => "after the failures nobody owns org.rdmad1 on the bus: rdmad is gone",
            None => "after the failures the bus does not answer",
        };
        shared
            .known
            .lock()
            .expect("known lock")
            .failures
            .push(note.to_owned());
    }
    report(&shared, elapsed);
}

fn report(shared: &Shared, elapsed: f64) {
    let known = shared.known.lock().expect("known lock");
    let made = shared.made.load(Ordering::Relaxed);
    let rate = made as f64 / elapsed.max(1e-9);
    if !shared.args.quiet {
        println!(
            "{:<52} {:>7} {:>7} {:>7}  errors",
            "method", "calls", "ok", "ill"
        );
        for (label, s) in &known.stats {
            let errors: Vec<String> = s
                .errors
                .iter()
                .map(|(name, n)| format!("{} {n}", rdmad_tests::short_error_name(name)))
                .collect();
            println!(
                "{label:<52} {:>7} {:>7} {:>7}  {}",
                s.calls,
                s.ok,
                s.ill_typed,
                errors.join(", ")
            );
        }
    }
    let ok: u64 = known.stats.values().map(|s| s.ok).sum();
    println!(
        "rdmad-fuzz-dbus: seed {}: {made} calls ({ok} succeeded) in {elapsed:.1} s: {rate:.0} calls/s; \
         {} spared, {} aborted by a reconnection, {} not sendable, {} undecodable (zbus); \
         {} findings, {} failures",
        shared.args.seed,
        known.spared,
        known.aborted,
        known.unsendable,
        known.zbus_refusals,
        known.findings.len(),
        known.failures.len()
    );
    for f in known.findings.iter().take(50) {
        println!("FINDING: {f}");
    }
    for f in known.failures.iter().take(50) {
        println!("FAILURE: {f}");
    }
    let summary = json!({
        "seed": shared.args.seed,
        "uid": shared.my_uid,
        "calls": made,
        "ok": ok,
        "seconds": elapsed,
        "calls_per_second": rate,
        "methods": known.stats,
        "findings": known.findings,
        "failures": known.failures,
        "spared": known.spared,
        "aborted": known.aborted,
        "unsendable": known.unsendable,
        "zbus_refusals": known.zbus_refusals,
    });
    if shared.args.summary {
        println!("summary {summary}");
    }
    let code = if !known.failures.is_empty() || shared.failed.load(Ordering::Relaxed) {
        2
    } else if !known.findings.is_empty() {
        1
    } else {
        0
    };
    drop(known);
    std::process::exit(code);
}
