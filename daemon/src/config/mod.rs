//! The configuration file, `/etc/rdmad/rdmad.toml`: strict (unknown keys are errors) and
//! validated as a whole before anything uses it. Every error names the file, the line and
//! the key, so an operator can go straight to the mistake.

use std::collections::HashSet;
use std::fmt;
use std::path::{Path, PathBuf};

use serde::Deserialize;

mod listen;
mod pool;
mod quota;
mod size;

pub use listen::{parse_ports, ListenConfig, ListenGrant};
pub use pool::{PoolConfig, HUGEPAGE, PAGE};
pub use quota::{QuotaKind, QuotaLimits, QuotaSection};
pub use size::ByteSize;

/// Where the packaged configuration lives.
pub const DEFAULT_PATH: &str = "/etc/rdmad/rdmad.toml";

#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    #[serde(default)]
    pub daemon: DaemonConfig,
    /// `[[device]]` tables: which devices to serve and how. Empty: every device found.
    #[serde(default, rename = "device")]
    pub devices: Vec<DeviceConfig>,
    /// `[[pool]]` tables. Empty: one built-in pool named `default`.
    #[serde(default, rename = "pool")]
    pub pools: Vec<PoolConfig>,
    #[serde(default)]
    pub quota: QuotaSection,
    /// Who may listen on which ports for connections by address.
    #[serde(default)]
    pub listen: ListenConfig,
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DaemonConfig {
    /// Which provider serves devices.
    #[serde(default)]
    pub provider: ProviderChoice,
    /// With `provider = "auto"`: serve the loopback device when no RDMA device exists.
    #[serde(default = "default_true")]
    pub loopback_fallback: bool,
    /// Members of this group are administrators (root always is).
    #[serde(default)]
    pub admin_group: Option<String>,
    #[serde(default)]
    pub log_level: LogLevel,
    /// Microseconds a data-path worker keeps polling after its last work before it
    /// sleeps on its eventfds (lower: less CPU; higher: lower latency under light load).
    #[serde(default = "default_spin_us")]
    pub worker_spin_us: u32,
    /// Data-path worker threads; queue pairs are spread over them (each new one goes to
    /// the worker serving the fewest). 0, the default: one per two CPUs rdmad may run on
    /// ([`default_workers`]).
    #[serde(default)]
    pub workers: u32,
}

fn default_spin_us() -> u32 {
    200
}

/// The most data-path workers a configuration may ask for.
pub const MAX_WORKERS: u32 = 256;

impl DaemonConfig {
    /// How many data-path workers to run: `workers`, or [`default_workers`] for the CPUs
    /// rdmad may run on.
    pub fn worker_count(&self) -> usize {
        match self.workers {
            0 => default_workers(
                std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get),
            ),
            n => n as usize,
        }
    }
}

/// The workers rdmad runs on `cpus` CPUs unless told otherwise: one per two CPUs, at least
/// one. A busy worker spins, and so does a client busy-polling its ring: with one worker
/// per CPU, busy workers and their spinning clients outnumbered the CPUs once more than
/// half the workers were busy, and every hand-off between them waited for the scheduler
/// (on a 2-vCPU Soft-RoCE guest, WRITE round trips through rdmad were 2.5–5× slower with
/// two workers than with one; docs/benchmarks.md, "One worker per two CPUs").
pub fn default_workers(cpus: usize) -> usize {
    cpus.div_ceil(2).max(1)
}

impl Default for DaemonConfig {
    fn default() -> Self {
        DaemonConfig {
            provider: ProviderChoice::default(),
            loopback_fallback: true,
            admin_group: None,
            log_level: LogLevel::default(),
            worker_spin_us: default_spin_us(),
            workers: 0,
        }
    }
}

fn default_true() -> bool {
    true
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum ProviderChoice {
    /// Kernel RDMA devices; the loopback device when there are none and
    /// `loopback_fallback` allows it.
    #[default]
    Auto,
    /// Kernel RDMA devices only; refuse to start without one.
    Verbs,
    /// Only rdmad's in-process loopback device.
    Loopback,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LogLevel {
    Error,
    Warn,
    #[default]
    Info,
    Debug,
    Trace,
}

impl LogLevel {
    pub fn as_str(self) -> &'static str {
        match self {
            LogLevel::Error => "error",
            LogLevel::Warn => "warn",
            LogLevel::Info => "info",
            LogLevel::Debug => "debug",
            LogLevel::Trace => "trace",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceConfig {
    /// Device name as the kernel (or `loopback0`) calls it.
    pub name: String,
    /// The port QPs use.
    #[serde(default = "default_port")]
    pub port: u8,
    /// Pin the GID index; absent: prefer the RoCE v2 IPv4-mapped GID.
    #[serde(default)]
    pub gid_index: Option<u32>,
}

fn default_port() -> u8 {
    1
}

/// A configuration error, located in its file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub file: PathBuf,
    /// 1-based; 0 when the error concerns the file as a whole.
    pub line: usize,
    /// The dotted key, e.g. `device[1].name`; empty when the error concerns the file.
    pub key: String,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.file.display())?;
        if self.line > 0 {
            write!(f, ":{}", self.line)?;
        }
        if !self.key.is_empty() {
            write!(f, ": {}", self.key)?;
        }
        write!(f, ": {}", self.message)
    }
}

impl std::error::Error for ConfigError {}

impl ConfigError {
    /// For an error found after parsing (e.g. a device the host does not have), which
    /// knows its key but not its line: the line of the key in the file, read again.
    pub fn located(mut self) -> ConfigError {
        if self.line == 0 && !self.key.is_empty() {
            if let Ok(bytes) = std::fs::read(&self.file) {
                self.line = KeyIndex::new(&String::from_utf8_lossy(&bytes)).line_of(&self.key);
            }
        }
        self
    }
}

/// The 1-based line of byte `offset` in `source`.
fn line_at(source: &[u8], offset: usize) -> usize {
    let offset = offset.min(source.len());
    source[..offset].iter().filter(|&&b| b == b'\n').count() + 1
}

/// The error for a file that is not UTF-8: the line and key of the first bad byte.
fn not_utf8(path: &Path, e: &std::string::FromUtf8Error) -> ConfigError {
    let bytes = e.as_bytes();
    let at = e.utf8_error().valid_up_to();
    let line = line_at(bytes, at);
    let line_start = bytes[..at]
        .iter()
        .rposition(|&b| b == b'\n')
        .map_or(0, |i| i + 1);
    ConfigError {
        file: path.to_owned(),
        line,
        key: KeyIndex::new(&String::from_utf8_lossy(bytes)).key_at(line),
        message: format!(
            "byte 0x{:02x} at column {} is not UTF-8; the configuration must be UTF-8 text",
            bytes[at],
            at - line_start + 1
        ),
    }
}

impl Config {
    /// Reads and validates `path`. A file that is missing or cannot be read is an error
    /// naming the file; one that is not UTF-8 names the line of the first bad byte.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let bytes = std::fs::read(path).map_err(|e| ConfigError {
            file: path.to_owned(),
            line: 0,
            key: String::new(),
            message: format!("cannot read the configuration: {e}"),
        })?;
        let source = String::from_utf8(bytes).map_err(|e| not_utf8(path, &e))?;
        Config::parse(path, &source)
    }

    /// The configuration at start: like [`Config::load`], except that a missing file at
    /// the packaged path means the built-in defaults (the shipped file configures exactly
    /// those, so a host where it was removed runs as if it were there). A missing file
    /// anywhere else (`--config PATH`) is an error: that path was asked for.
    ///
    /// At reload a missing file is refused wherever it is (see [`Config::check_present`]):
    /// the running configuration stays rather than silently turning into the defaults.
    pub fn load_or_default(path: &Path) -> Result<Config, ConfigError> {
        if path == Path::new(DEFAULT_PATH) && !path.exists() {
            tracing::info!("{DEFAULT_PATH} does not exist; using the built-in defaults");
            return Ok(Config::default());
        }
        Config::load(path)
    }

    /// Before a reload: the file must exist, even at the packaged path where a missing file
    /// means the defaults at start. A file deleted while rdmad runs is most likely a mistake
    /// or a half-done edit; to go back to the defaults, install the shipped file again (or
    /// an empty one).
    pub fn check_present(path: &Path) -> Result<(), ConfigError> {
        match std::fs::metadata(path) {
            Ok(_) => Ok(()),
            Err(e) => Err(ConfigError {
                file: path.to_owned(),
                line: 0,
                key: String::new(),
                message: format!("cannot read the configuration: {e}"),
            }),
        }
    }

    /// Parses and validates `source`, naming `path` in errors.
    pub fn parse(path: &Path, source: &str) -> Result<Config, ConfigError> {
        let keys = KeyIndex::new(source);
        let config: Config = toml::from_str(source).map_err(|e| {
            let mut line = e
                .span()
                .map(|span| line_at(source.as_bytes(), span.start))
                .unwrap_or(0);
            // toml sometimes says more on a second line; an error is one line in the log.
            let mut message = e
                .message()
                .lines()
                .map(str::trim)
                .filter(|l| !l.is_empty())
                .collect::<Vec<_>>()
                .join(": ");
            if message.is_empty() {
                // toml says nothing of some characters (a lone carriage return in a
                // comment, say); name the one it stopped at.
                let at = e.span().and_then(|s| source.get(s.start..)?.chars().next());
                message = match at {
                    Some(c) => format!(
                        "invalid TOML: unexpected character {c:?} (U+{:04X})",
                        u32::from(c)
                    ),
                    None => "invalid TOML".to_owned(),
                };
            }
            let mut key = keys.key_at(line);
            // serde reports an unknown key at its table; point at the key itself.
            if let Some(field) = unknown_field(&message) {
                if let Some((found, dotted)) = keys.field_from(line, field) {
                    (line, key) = (found, dotted);
                }
            }
            // A duplicate is reported at its first definition; the mistake is the second.
            if message.starts_with("duplicate key") {
                if let Some(last) = keys.last_line(&key) {
                    line = last;
                }
            }
            ConfigError {
                file: path.to_owned(),
                line,
                key,
                message,
            }
        })?;
        config.validate().map_err(|(key, message)| ConfigError {
            file: path.to_owned(),
            line: keys.line_of(&key),
            key,
            message,
        })?;
        Ok(config)
    }

    /// Checks what the types alone cannot; the error names the key.
    fn validate(&self) -> Result<(), (String, String)> {
        if let Some(group) = &self.daemon.admin_group {
            crate::lock::check_lookup("daemon.admin_group");
            match nix::unistd::Group::from_name(group) {
                Ok(Some(_)) => {}
                Ok(None) => {
                    return Err((
                        "daemon.admin_group".into(),
                        format!("there is no group named {group:?} on this system"),
                    ))
                }
                Err(e) => {
                    return Err((
                        "daemon.admin_group".into(),
                        format!("cannot look up group {group:?}: {e}"),
                    ))
                }
            }
        }
        if self.daemon.worker_spin_us > 1_000_000 {
            return Err((
                "daemon.worker_spin_us".into(),
                format!(
                    "{} µs is more than a second of busy polling; use at most 1000000",
                    self.daemon.worker_spin_us
                ),
            ));
        }
        if self.daemon.workers > MAX_WORKERS {
            return Err((
                "daemon.workers".into(),
                format!(
                    "{} data-path workers is more than {MAX_WORKERS}; use 0 (one per two \
                     CPUs) or at most {MAX_WORKERS}",
                    self.daemon.workers
                ),
            ));
        }
        let mut names = HashSet::new();
        for (i, dev) in self.devices.iter().enumerate() {
            if dev.name.is_empty() {
                return Err((format!("device[{i}].name"), "must not be empty".into()));
            }
            if !names.insert(dev.name.as_str()) {
                return Err((
                    format!("device[{i}].name"),
                    format!("device {:?} is configured twice", dev.name),
                ));
            }
            if dev.port == 0 {
                return Err((
                    format!("device[{i}].port"),
                    "ports are numbered from 1".into(),
                ));
            }
        }
        let mut pool_names = HashSet::new();
        for (i, pool) in self.pools.iter().enumerate() {
            pool.validate(i)?;
            if !pool_names.insert(pool.name.as_str()) {
                return Err((
                    format!("pool[{i}].name"),
                    format!("pool {:?} is configured twice", pool.name),
                ));
            }
            if let (Some(device), false) = (&pool.device, self.devices.is_empty()) {
                if self.device(device).is_none() {
                    return Err((
                        format!("pool[{i}].device"),
                        format!("device {device:?} is not one of the [[device]] tables"),
                    ));
                }
            }
        }
        self.listen.validate()?;
        self.quota.validate()
    }

    /// The pools served: the configured ones, or the built-in `default` pool.
    pub fn effective_pools(&self) -> Vec<PoolConfig> {
        if self.pools.is_empty() {
            vec![PoolConfig::builtin_default()]
        } else {
            self.pools.clone()
        }
    }

    /// The `[[device]]` entry for `name`, if any.
    pub fn device(&self, name: &str) -> Option<&DeviceConfig> {
        self.devices.iter().find(|d| d.name == name)
    }
}

/// Whether the system knows a user named `name`.
fn user_exists(name: &str) -> bool {
    crate::lock::check_lookup("user_exists");
    matches!(nix::unistd::User::from_name(name), Ok(Some(_)))
}

/// Whether the system knows a group named `name`.
fn group_exists(name: &str) -> bool {
    crate::lock::check_lookup("group_exists");
    matches!(nix::unistd::Group::from_name(name), Ok(Some(_)))
}

/// The field name in serde's "unknown field `x`, expected …" message.
fn unknown_field(message: &str) -> Option<&str> {
    message.strip_prefix("unknown field `")?.split('`').next()
}

/// `name` as one segment of a dotted key in error messages, written as TOML would: bare
/// when it can be, else quoted (`quota.user."alice.smith"`).
pub fn key_segment(name: &str) -> String {
    if !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
    {
        name.to_owned()
    } else {
        format!("\"{}\"", name.replace('\\', "\\\\").replace('"', "\\\""))
    }
}

/// Reads a dotted TOML key (bare, "basic" or 'literal' segments) at the start of `text`:
/// the key in the form [`key_segment`] writes, and the rest of the text.
fn read_key(text: &str) -> Option<(String, &str)> {
    let mut segments = Vec::new();
    let mut rest = text.trim_start();
    loop {
        let (segment, after) = if let Some(quoted) = rest.strip_prefix('"') {
            let mut segment = String::new();
            let mut chars = quoted.char_indices();
            loop {
                match chars.next()? {
                    (i, '"') => break (segment, &quoted[i + 1..]),
                    (_, '\\') => segment.push(chars.next()?.1),
                    (_, c) => segment.push(c),
                }
            }
        } else if let Some(literal) = rest.strip_prefix('\'') {
            let end = literal.find('\'')?;
            (literal[..end].to_owned(), &literal[end + 1..])
        } else {
            let end = rest
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '-'))
                .unwrap_or(rest.len());
            if end == 0 {
                return None;
            }
            (rest[..end].to_owned(), &rest[end..])
        };
        segments.push(key_segment(&segment));
        let after = after.trim_start();
        match after.strip_prefix('.') {
            Some(next) => rest = next.trim_start(),
            None => return Some((segments.join("."), after)),
        }
    }
}

/// The table a header line names, after its opening bracket(s). A malformed header
/// (`[daemon`) still counts, so its error names the table; a line of a multi-line array
/// (`[1, 2],`) does not.
fn header_name(rest: &str, close: &str) -> Option<String> {
    let (name, after) = read_key(rest)?;
    (after.is_empty() || after.starts_with(close) || after.starts_with('#')).then_some(name)
}

/// Which dotted key each line of a TOML file defines, for error messages. Understands the
/// layout the shipped file uses (`[table]`, `[[array]]`, `key = value`, dotted and quoted
/// keys); anything fancier falls back to the enclosing table.
struct KeyIndex {
    /// (1-based line, dotted key)
    lines: Vec<(usize, String)>,
}

impl KeyIndex {
    fn new(source: &str) -> KeyIndex {
        let mut lines = Vec::new();
        let mut table = String::new();
        let mut array_counts: std::collections::HashMap<String, usize> = Default::default();
        for (n, raw) in source.lines().enumerate() {
            let line = raw.trim_start();
            if let Some(rest) = line.strip_prefix("[[") {
                if let Some(name) = header_name(rest, "]]") {
                    let count = array_counts.entry(name.clone()).or_insert(0);
                    table = format!("{name}[{count}]");
                    *count += 1;
                    lines.push((n + 1, table.clone()));
                }
            } else if let Some(rest) = line.strip_prefix('[') {
                if let Some(name) = header_name(rest, "]") {
                    table = name;
                    lines.push((n + 1, table.clone()));
                }
            } else if let Some((key, after)) = read_key(line) {
                if after.starts_with('=') {
                    let dotted = if table.is_empty() {
                        key
                    } else {
                        format!("{table}.{key}")
                    };
                    lines.push((n + 1, dotted));
                }
            }
        }
        KeyIndex { lines }
    }

    /// The key defined on `line`, else the table the line belongs to.
    fn key_at(&self, line: usize) -> String {
        self.lines
            .iter()
            .rev()
            .find(|(l, _)| *l <= line)
            .map(|(_, key)| key.clone())
            .unwrap_or_default()
    }

    /// The first key named `field` defined at or after `line`, with its line.
    fn field_from(&self, line: usize, field: &str) -> Option<(usize, String)> {
        self.lines
            .iter()
            .find(|(l, k)| *l >= line && k.rsplit('.').next() == Some(field))
            .cloned()
    }

    /// The last line defining exactly `key`.
    fn last_line(&self, key: &str) -> Option<usize> {
        self.lines
            .iter()
            .rev()
            .find(|(_, k)| k == key)
            .map(|(line, _)| *line)
    }

    /// The line defining `key`, else its table's header line, else 0.
    fn line_of(&self, key: &str) -> usize {
        let mut candidate = key;
        loop {
            if let Some((line, _)) = self.lines.iter().find(|(_, k)| k == candidate) {
                return *line;
            }
            match candidate.rsplit_once('.') {
                Some((parent, _)) => candidate = parent,
                None => return 0,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(source: &str) -> Result<Config, ConfigError> {
        Config::parse(Path::new("/etc/rdmad/rdmad.toml"), source)
    }

    #[test]
    fn shipped_config_loads_as_is_and_equals_the_defaults() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/rdmad.toml");
        let config = Config::load(&path).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(config, Config::default());
        assert!(
            config.daemon.loopback_fallback,
            "the shipped default allows loopback"
        );
    }

    #[test]
    fn empty_file_means_defaults() {
        assert_eq!(parse("").unwrap(), Config::default());
    }

    #[test]
    fn full_file_parses() {
        let config = parse(
            "[daemon]\nprovider = \"verbs\"\nloopback_fallback = false\nlog_level = \"debug\"\n\
             admin_group = \"root\"\n\n[[device]]\nname = \"rxe0\"\nport = 1\ngid_index = 1\n\n\
             [[device]]\nname = \"mlx5_0\"\n",
        )
        .unwrap();
        assert_eq!(config.daemon.provider, ProviderChoice::Verbs);
        assert!(!config.daemon.loopback_fallback);
        assert_eq!(config.daemon.log_level, LogLevel::Debug);
        assert_eq!(config.devices.len(), 2);
        assert_eq!(config.device("rxe0").unwrap().gid_index, Some(1));
        assert_eq!(config.device("mlx5_0").unwrap().port, 1);
    }

    /// Each bad file is refused with the file, the line and the key of the mistake.
    #[test]
    fn errors_name_file_line_and_key() {
        let cases: &[(&str, usize, &str, &str)] = &[
            (
                "[daemon]\nprovidr = \"verbs\"\n",
                2,
                "daemon.providr",
                "unknown field",
            ),
            (
                "[daemon]\n\nprovider = \"verb\"\n",
                3,
                "daemon.provider",
                "unknown variant",
            ),
            (
                "[daemon]\nloopback_fallback = \"yes\"\n",
                2,
                "daemon.loopback_fallback",
                "invalid type",
            ),
            ("[deamon]\n", 1, "deamon", "unknown field"),
            (
                "[[device]]\nname = \"a\"\n[[device]]\nname = \"b\"\nport = -1\n",
                5,
                "device[1].port",
                "invalid value",
            ),
            (
                "[[device]]\nname = \"a\"\n[[device]]\nname = \"a\"\n",
                4,
                "device[1].name",
                "configured twice",
            ),
            (
                "[[device]]\nname = \"a\"\nport = 0\n",
                3,
                "device[0].port",
                "numbered from 1",
            ),
            (
                "[[device]]\nport = 1\n",
                1,
                "device[0]",
                "missing field `name`",
            ),
            (
                "[daemon]\nadmin_group = \"no-such-group-here\"\n",
                2,
                "daemon.admin_group",
                "no group named",
            ),
            (
                "[daemon]\nlog_level = \"info\"\nlog_level = \"debug\"\n",
                3,
                "daemon.log_level",
                "duplicate key",
            ),
            ("[daemon\n", 1, "daemon", "invalid table header"),
            ("[daemon]\n#\rcomment\n", 2, "daemon", "unexpected character '\\r'"),
            ("[[pool]]\nname = \"p\"\ncapacity = \"1GiB\"\n", 1, "pool[0].size_classes", "set size_classes"),
            ("[[pool]]\nname = \"p\"\ncapacity = \"1GB\"\n", 3, "pool[0].capacity", "unknown unit"),
            ("[[pool]]\nname = \"p\"\ncapacity = -4096\nsize_classes = [4096]\n", 3, "pool[0].capacity", "negative"),
            ("[[pool]]\nname = \"p\"\ncapacity = \"1MiB\"\nsize_classes = [\"4KiB\", \"2MiB\"]\n", 4, "pool[0].size_classes", "larger than the capacity"),
            ("[[pool]]\nname = \"p\"\ncapacity = \"1MiB\"\nsize_classes = [\"64KiB\", \"4KiB\"]\n", 4, "pool[0].size_classes", "smallest first"),
            ("[[pool]]\nname = \"p\"\ncapacity = \"1MiB\"\nsize_classes = [\"5000\"]\n", 4, "pool[0].size_classes", "multiple of the page size"),
            ("[[pool]]\nname = \"p\"\ncapacity = \"1MiB\"\nsize_classes = [\"512KiB\"]\nwarm = 4\n", 5, "pool[0].warm", "more than the capacity"),
            ("[[pool]]\nname = \"p\"\ncapacity = \"1MiB\"\ngranularity = \"4KiB\"\nwarm = 1\n", 5, "pool[0].warm", "need size_classes"),
            ("[[pool]]\nname = \"p\"\ncapacity = \"4MiB\"\nsize_classes = [\"4KiB\"]\nhugepages = true\n", 4, "pool[0].size_classes", "2MiB"),
            ("[[pool]]\nname = \"a b\"\ncapacity = 4096\nsize_classes = [4096]\n", 2, "pool[0].name", "letters, digits"),
            ("[[pool]]\nname = \"p\"\ncapacity = 4096\nsize_classes = [4096]\nusers = [\"no-such-user-x\"]\n", 5, "pool[0].users", "no user named"),
            ("[[pool]]\nname = \"p\"\ncapacity = 4096\nsize_classes = [4096]\n[[pool]]\nname = \"p\"\ncapacity = 4096\nsize_classes = [4096]\n", 6, "pool[1].name", "configured twice"),
            ("[[device]]\nname = \"a\"\n[[pool]]\nname = \"p\"\ndevice = \"b\"\ncapacity = 4096\nsize_classes = [4096]\n", 5, "pool[0].device", "not one of the [[device]]"),
            ("[quota.default]\nregions = -1\n", 2, "quota.default.regions", "invalid value"),
            ("[daemon]\nworker_spin_us = 5000000\n", 2, "daemon.worker_spin_us", "busy polling"),
            ("[daemon]\nworkers = 1000\n", 2, "daemon.workers", "one per two CPUs"),
            ("[quota.default]\nregions = 100000000000\n", 2, "quota.default.regions", "absurd"),
            ("[quota.default]\nregion = 10\n", 2, "quota.default.region", "unknown field"),
            ("[quota.user.nobody]\nexports = 100000000000\n", 2, "quota.user.nobody.exports", "absurd"),
            ("[quota.group.root]\nexports = \"many\"\n", 2, "quota.group.root.exports", "invalid type"),
            ("[quota.user.no-such-user-x]\nregions = 1\n", 1, "quota.user.no-such-user-x", "no user named"),
            ("[quota.group.root]\nregistered_bytes = \"2 PiB\"\n", 2, "quota.group.root.registered_bytes", "unknown unit"),
            // An error toml places at the start of a line is on that line, not the one before.
            ("[quota.default]\nregions = 7\n\n[[pool]]\ncapacity = \"1MiB\"\n", 4, "pool[0]", "missing field `name`"),
            ("[daemon]\nlog_level = \"info\"\n[daemon]\n", 3, "daemon", "invalid table header: duplicate key `daemon`"),
            // Quoted and dotted keys are found as TOML reads them.
            ("[quota.user.\"no.such.user\"]\nregions = 1\n", 1, "quota.user.\"no.such.user\"", "no user named"),
            ("[quota.user.'root']\nregions = 100000000000\n", 2, "quota.user.root.regions", "absurd"),
            ("[quota]\ndefault . \"regions\" = 100000000000\n", 2, "quota.default.regions", "absurd"),
            ("[quota.default]\nregions = 7\n# keys = 5\n\"keys\" = -5\n", 4, "quota.default.keys", "invalid value"),
        ];
        for (source, line, key, message) in cases {
            let e = parse(source).expect_err(source);
            assert_eq!(e.file, Path::new("/etc/rdmad/rdmad.toml"), "{source}");
            assert_eq!((e.line, e.key.as_str()), (*line, *key), "{source}: {e}");
            assert!(e.message.contains(message), "{source}: {e}");
            assert!(!e.message.contains('\n'), "{source}: {e}");
            let shown = e.to_string();
            assert!(
                shown.starts_with(&format!("/etc/rdmad/rdmad.toml:{line}")),
                "{shown}"
            );
        }
    }

    #[test]
    fn a_file_that_is_not_utf8_names_the_line_and_key_of_the_bad_byte() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("rdmad.toml");
        std::fs::write(
            &path,
            b"[daemon]\nlog_level = \"info\"\nadmin_group = \"r\xffot\"\n",
        )
        .unwrap();
        let e = Config::load(&path).unwrap_err();
        assert_eq!((e.line, e.key.as_str()), (3, "daemon.admin_group"), "{e}");
        assert!(
            e.message.starts_with("byte 0xff at column 17 is not UTF-8"),
            "{e}"
        );
    }

    /// Errors found after parsing (the engine's, about devices) get their line from the file.
    #[test]
    fn located_errors_find_their_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("rdmad.toml");
        std::fs::write(
            &path,
            "[daemon]\n\n[[device]]\nname = \"a\"\n[[device]]\nname = \"b\"\n",
        )
        .unwrap();
        let e = ConfigError {
            file: path.clone(),
            line: 0,
            key: "device[1].name".into(),
            message: "no device named \"b\" on this host".into(),
        };
        assert_eq!(e.located().line, 6);
    }

    /// A missing file: the defaults at start at the packaged path only; an error at any
    /// other path; and an error at reload wherever it is.
    #[test]
    fn missing_file_means_defaults_only_at_the_packaged_path_at_start() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("rdmad.toml");
        let e = Config::load_or_default(&path).unwrap_err();
        assert_eq!((e.line, e.key.as_str()), (0, ""));
        assert!(
            e.message.starts_with("cannot read the configuration: "),
            "{e}"
        );
        let e = Config::check_present(&path).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!(
                "{}: cannot read the configuration: No such file or directory (os error 2)",
                path.display()
            )
        );
        std::fs::write(&path, "").unwrap();
        Config::check_present(&path).unwrap();
        if !Path::new(DEFAULT_PATH).exists() {
            assert_eq!(
                Config::load_or_default(Path::new(DEFAULT_PATH)).unwrap(),
                Config::default()
            );
            assert!(Config::check_present(Path::new(DEFAULT_PATH)).is_err());
        }
    }

    #[test]
    fn unreadable_file_is_named() {
        let e = Config::load(Path::new("/nonexistent/rdmad.toml")).unwrap_err();
        assert_eq!(e.line, 0);
        assert!(
            e.to_string()
                .starts_with("/nonexistent/rdmad.toml: cannot read"),
            "{e}"
        );
    }

    #[test]
    fn the_default_is_a_worker_per_two_cpus_and_never_none() {
        let got: Vec<usize> = [1, 2, 3, 4, 5, 64].map(default_workers).to_vec();
        assert_eq!(got, [1, 1, 2, 2, 3, 32]);
        // An explicit count is taken as it is, even on fewer CPUs.
        let explicit = DaemonConfig {
            workers: 3,
            ..Config::default().daemon
        };
        assert_eq!(explicit.worker_count(), 3);
    }
}
