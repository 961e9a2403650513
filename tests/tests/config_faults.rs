//! Configuration faults (issue #6): one table of invalid configuration files. Each of them
//!
//! - stops `rdmad` at start, exit status 1, before it owns `org.rdmad1`, with an error
//!   naming the file, the line and the key, on the first line of stderr;
//! - is refused by `rdmad --check-config` with that very line;
//! - is refused by `Manager.Reload` with `org.rdmad1.Error.InvalidArgument` carrying the
//!   same location, the configuration in force staying (same limits, `NReloads` unchanged)
//!   and the daemon serving on. One daemon takes every row, the file rewritten in between.
//!
//! A *missing* file (`Config::load_or_default` at start, `Config::check_present` at reload):
//! at start, a `--config PATH` that does not exist is an error like any unreadable file
//! (the row "missing file"), except at the packaged path `/etc/rdmad/rdmad.toml`, where it
//! means the built-in defaults, which the shipped file only spells out. At reload a missing
//! file is refused wherever it is, the packaged path too: the running configuration stays
//! rather than silently turning into the defaults (to go back to them, reinstall the shipped
//! file). The packaged path is covered by the config unit tests, as testing it here would
//! mean deleting the host's own file.
//!
//! Files that are valid TOML for rdmad but name a device the host does not have
//! (`HOST_FAULTS`) are found against the host's devices: they stop the start with file,
//! line and key too, and a reload refuses them like the rest (the next start would), while
//! `--check-config`, which reads the file and not the host, passes them.
//!
//! Tests run as root, so a file without read permission is still readable: "unreadable" here
//! is a directory, and a file that is not UTF-8.

use std::path::Path;
use std::process::{Output, Stdio};

use futures_util::{FutureExt, StreamExt};
use rdmad_client::proxy::ManagerProxy;
use rdmad_client::{Error, BUS_NAME};
use rdmad_tests::bus::PrivateBus;
use rdmad_tests::daemon::start_loopback;
use rdmad_tests::{binary, NOBODY, TIMEOUT};

/// What is at the configuration path.
#[derive(Debug, Clone, Copy)]
enum Contents {
    Text(&'static str),
    Bytes(&'static [u8]),
    /// A directory where the file should be.
    Directory,
    /// Nothing.
    Missing,
}

/// One invalid configuration and where its error points.
struct Fault {
    what: &'static str,
    contents: Contents,
    /// 1-based; 0 for an error about the file as a whole.
    line: usize,
    /// The dotted key; empty for an error about the file as a whole.
    key: &'static str,
    /// Part of the message after the location.
    message: &'static str,
}

use Contents::{Bytes, Directory, Missing, Text};

const fn fault(
    what: &'static str,
    contents: Contents,
    line: usize,
    key: &'static str,
    message: &'static str,
) -> Fault {
    Fault {
        what,
        contents,
        line,
        key,
        message,
    }
}

/// The table: every row is checked at start, by `--check-config` and on reload.
const FAULTS: &[Fault] = &[
    fault(
        "a listen port range written backwards",
        Text("[listen]\nopen_ports = [\"2000-1024\"]\n"),
        2,
        "listen.open_ports",
        "\"2000-1024\" is an empty range: write the lower port first",
    ),
    fault(
        "a listen grant for nobody in particular",
        Text("[[listen.grant]]\nports = [\"80\"]\n"),
        1,
        "listen.grant[0]",
        "a grant names users or groups",
    ),
    fault(
        "unknown top-level key (a [daemon] key without its table)",
        Text("# rdmad\nlog_level = \"debug\"\n"),
        2,
        "log_level",
        "unknown field `log_level`, expected one of `daemon`, `device`, `pool`, `quota`",
    ),
    fault(
        "unknown table",
        Text("[quota.default]\nregions = 7\n\n[deamon]\nlog_level = \"debug\"\n"),
        4,
        "deamon",
        "unknown field `deamon`",
    ),
    fault(
        "unknown key in a nested table",
        Text("[quota.default]\nregions = 7\n\n[quota.user.nobody]\nregion = 5\n"),
        5,
        "quota.user.nobody.region",
        "unknown field `region`, expected one of `sessions`, `regions`",
    ),
    fault(
        "unknown key in the second of an array of tables",
        Text(
            "[[pool]]\nname = \"small\"\ncapacity = \"1MiB\"\nsize_classes = [\"4KiB\"]\n\n\
             [[pool]]\nname = \"big\"\ncapacity = \"4MiB\"\nsize_classes = [\"1MiB\"]\nwarmth = 1\n",
        ),
        10,
        "pool[1].warmth",
        "unknown field `warmth`",
    ),
    fault(
        "wrong type",
        Text("[quota.default]\nsessions = \"many\"\n"),
        2,
        "quota.default.sessions",
        "invalid type: string \"many\", expected u64",
    ),
    fault(
        "unknown value of an enumeration",
        Text("[daemon]\nlog_level = \"info\"\nprovider = \"loopbak\"\n"),
        3,
        "daemon.provider",
        "unknown variant `loopbak`",
    ),
    fault(
        "negative quota",
        Text("[quota.default]\n\nregions = -1\n"),
        3,
        "quota.default.regions",
        "invalid value: integer `-1`, expected u64",
    ),
    fault(
        "negative size quota",
        Text("[quota.user.nobody]\nregistered_bytes = -4096\n"),
        2,
        "quota.user.nobody.registered_bytes",
        "-4096 is negative; sizes are 0 or more bytes",
    ),
    fault(
        "absurd quota",
        Text("[quota.default]\nregions = 7\nkeys = 100000000000\n"),
        3,
        "quota.default.keys",
        "100000000000 is absurd (the most rdmad accepts is 16777216)",
    ),
    fault(
        "absurd size quota",
        Text("[quota.group.root]\nregistered_bytes = \"2048TiB\"\n"),
        2,
        "quota.group.root.registered_bytes",
        "is absurd (the most rdmad accepts is 1125899906842624)",
    ),
    fault(
        "quota of an unknown user",
        Text("[quota.default]\nregions = 7\n\n[quota.user.no-such-user-x]\nregions = 1\n"),
        4,
        "quota.user.no-such-user-x",
        "there is no user named \"no-such-user-x\"",
    ),
    fault(
        "quota of an unknown user, quoted",
        Text("[quota.user.\"no.such.user\"]\nkeys = 1\n"),
        1,
        "quota.user.\"no.such.user\"",
        "there is no user named \"no.such.user\"",
    ),
    fault(
        "quota of an unknown group",
        Text("[quota.group.no-such-group-x]\nregions = 1\n"),
        1,
        "quota.group.no-such-group-x",
        "there is no group named \"no-such-group-x\"",
    ),
    fault(
        "unknown admin group",
        Text("[daemon]\nadmin_group = \"no-such-group-x\"\n"),
        2,
        "daemon.admin_group",
        "there is no group named \"no-such-group-x\" on this system",
    ),
    fault(
        "pool on a device that is not configured",
        Text(
            "[[device]]\nname = \"loopback0\"\n\n[[pool]]\nname = \"small\"\n\
             device = \"mlx5_0\"\ncapacity = \"1MiB\"\nsize_classes = [\"4KiB\"]\n",
        ),
        6,
        "pool[0].device",
        "device \"mlx5_0\" is not one of the [[device]] tables",
    ),
    fault(
        "pool for an unknown user",
        Text(
            "[[pool]]\nname = \"small\"\ncapacity = \"1MiB\"\nsize_classes = [\"4KiB\"]\n\
             users = [\"nobody\", \"no-such-user-x\"]\n",
        ),
        5,
        "pool[0].users",
        "there is no user named \"no-such-user-x\"",
    ),
    fault(
        "duplicate device name",
        Text("[[device]]\nname = \"loopback0\"\n\n[[device]]\nname = \"loopback0\"\n"),
        5,
        "device[1].name",
        "device \"loopback0\" is configured twice",
    ),
    fault(
        "device port 0",
        Text("[[device]]\nname = \"loopback0\"\nport = 0\n"),
        3,
        "device[0].port",
        "ports are numbered from 1",
    ),
    fault(
        "duplicate pool name",
        Text(
            "[[pool]]\nname = \"small\"\ncapacity = \"1MiB\"\nsize_classes = [\"4KiB\"]\n\
             [[pool]]\nname = \"small\"\ncapacity = \"2MiB\"\nsize_classes = [\"4KiB\"]\n",
        ),
        6,
        "pool[1].name",
        "pool \"small\" is configured twice",
    ),
    fault(
        "missing required key",
        Text("[quota.default]\nregions = 7\n\n[[pool]]\ncapacity = \"1MiB\"\nsize_classes = [\"4KiB\"]\n"),
        4,
        "pool[0]",
        "missing field `name`",
    ),
    fault(
        "duplicate key",
        Text("[quota.default]\nregions = 7\nkeys = 5\nregions = 8\n"),
        4,
        "quota.default.regions",
        "duplicate key `regions` in table `quota.default`",
    ),
    fault(
        "duplicate table",
        Text("[quota.default]\nregions = 7\n\n[quota.default]\nkeys = 5\n"),
        4,
        "quota.default",
        "invalid table header: duplicate key `default` in table `quota`",
    ),
    fault(
        "bad size unit",
        Text("[quota.default]\nregistered_bytes = \"1GB\"\n"),
        2,
        "quota.default.registered_bytes",
        "\"1GB\": unknown unit \"GB\" (use B, KiB, MiB, GiB or TiB)",
    ),
    fault(
        "size class that is not a whole number of pages",
        Text("[[pool]]\nname = \"small\"\ncapacity = \"1MiB\"\nsize_classes = [\"4KiB\", 5000]\n"),
        4,
        "pool[0].size_classes",
        "not a positive multiple of the page size",
    ),
    fault(
        "malformed TOML: unterminated string",
        Text("[daemon]\nlog_level = \"debug\n"),
        2,
        "daemon.log_level",
        "invalid basic string",
    ),
    fault(
        "malformed TOML: unclosed table header",
        Text("[quota.default]\nregions = 7\n[daemon\n"),
        3,
        "daemon",
        "invalid table header",
    ),
    fault(
        "malformed TOML: no `=`",
        Text("[quota.default]\nregions 7\n"),
        2,
        "quota.default",
        "expected `.`, `=`",
    ),
    fault(
        "not UTF-8",
        Bytes(b"[daemon]\nlog_level = \"info\"\nadmin_group = \"r\xffot\"\n"),
        3,
        "daemon.admin_group",
        "byte 0xff at column 17 is not UTF-8; the configuration must be UTF-8 text",
    ),
    fault(
        "a directory instead of a file",
        Directory,
        0,
        "",
        "cannot read the configuration: Is a directory (os error 21)",
    ),
    fault(
        "missing file",
        Missing,
        0,
        "",
        "cannot read the configuration: No such file or directory (os error 2)",
    ),
];

/// Valid files naming devices this host (the loopback provider) does not have: refused at
/// start, with file, line and key, once the devices are opened.
const HOST_FAULTS: &[Fault] = &[
    fault(
        "device the host does not have",
        Text("[quota.default]\nregions = 7\n\n[[device]]\nname = \"mlx5_0\"\n"),
        5,
        "device[0].name",
        "no device named \"mlx5_0\" on this host (found: loopback0)",
    ),
    fault(
        "pool on a device that is not served",
        Text(
            "[[pool]]\nname = \"small\"\ncapacity = \"1MiB\"\nsize_classes = [\"4KiB\"]\n\
             device = \"mlx5_0\"\n",
        ),
        5,
        "pool[0].device",
        "no device named \"mlx5_0\" is served",
    ),
];

/// The file the reload test starts with: limits visible through `Manager.GetQuota`.
const GOOD: &str = "[quota.default]\nregions = 7\n\n[quota.user.nobody]\nkeys = 5\n";

/// The location `ConfigError` prints before its message: `FILE:LINE: KEY: `, or `FILE: `
/// for an error about the whole file.
fn located(path: &Path, fault: &Fault) -> String {
    let mut s = path.display().to_string();
    if fault.line > 0 {
        s += &format!(":{}", fault.line);
    }
    if !fault.key.is_empty() {
        s += &format!(": {}", fault.key);
    }
    s + ": "
}

/// Puts `contents` at `path`, replacing whatever is there.
fn place(path: &Path, contents: Contents) {
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.is_dir() => std::fs::remove_dir(path).expect("remove directory"),
        Ok(_) => std::fs::remove_file(path).expect("remove file"),
        Err(_) => {}
    }
    match contents {
        Text(text) => std::fs::write(path, text).expect("write config"),
        Bytes(bytes) => std::fs::write(path, bytes).expect("write config"),
        Directory => std::fs::create_dir(path).expect("create directory"),
        Missing => {}
    }
}

/// Runs `rdmad` on `bus` with `config` to its exit (it must exit: the file is bad).
async fn run_rdmad(bus: &PrivateBus, config: &Path, what: &str) -> Output {
    let child = tokio::process::Command::new(binary("rdmad"))
        .arg("--bus")
        .arg(&bus.address)
        .args(["--provider", "loopback", "--log-target", "stderr"])
        .arg("--config")
        .arg(config)
        .env_remove("NOTIFY_SOCKET")
        .env_remove("WATCHDOG_USEC")
        .env_remove("WATCHDOG_PID")
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn rdmad");
    tokio::time::timeout(TIMEOUT, child.wait_with_output())
        .await
        .unwrap_or_else(|_| panic!("{what}: rdmad did not exit within {TIMEOUT:?}"))
        .expect("wait for rdmad")
}

/// `rdmad --check-config --config PATH`.
fn check_config(config: &Path) -> Output {
    std::process::Command::new(binary("rdmad"))
        .arg("--check-config")
        .arg("--config")
        .arg(config)
        .stdin(Stdio::null())
        .output()
        .expect("run rdmad --check-config")
}

/// Subscribes to the bus name's owner changes, to tell afterwards whether anyone took it.
async fn watch_name(
    bus: &PrivateBus,
) -> (
    zbus::fdo::DBusProxy<'static>,
    zbus::fdo::NameOwnerChangedStream,
) {
    let connection = bus.connect().await;
    let dbus = zbus::fdo::DBusProxy::new(&connection).await.unwrap();
    let changes = dbus
        .receive_name_owner_changed_with_args(&[(0, BUS_NAME)])
        .await
        .unwrap();
    (dbus, changes)
}

/// Asserts nobody owns the bus name now and nobody owned it since `watch_name`.
async fn assert_name_never_owned(
    dbus: &zbus::fdo::DBusProxy<'static>,
    changes: &mut zbus::fdo::NameOwnerChangedStream,
) {
    // A round trip: any NameOwnerChanged the bus sent before it is queued by now.
    assert!(!dbus
        .name_has_owner(BUS_NAME.try_into().unwrap())
        .await
        .unwrap());
    if let Some(Some(change)) = changes.next().now_or_never() {
        panic!(
            "{BUS_NAME} changed owner: {:?}",
            change
                .args()
                .map(|a| format!("{:?} -> {:?}", a.old_owner, a.new_owner))
        );
    }
}

/// Every row stops the daemon at start with file, line and key on its first stderr line;
/// `--check-config` exits 1 with exactly that line.
#[tokio::test(flavor = "multi_thread")]
async fn every_invalid_config_stops_the_start_with_file_line_and_key() {
    let bus = PrivateBus::start();
    let (dbus, mut changes) = watch_name(&bus).await;
    for fault in FAULTS {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("rdmad.toml");
        place(&path, fault.contents);
        let expected = format!("rdmad: {}", located(&path, fault));

        let out = run_rdmad(&bus, &path, fault.what).await;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{}: {stderr}", fault.what);
        let first = stderr.lines().next().unwrap_or_default();
        assert!(
            first.starts_with(&expected) && first[expected.len()..].contains(fault.message),
            "{}: expected {expected}…{}…, got\n{stderr}",
            fault.what,
            fault.message
        );
        assert!(out.stdout.is_empty(), "{}", fault.what);

        let check = check_config(&path);
        assert_eq!(check.status.code(), Some(1), "{}", fault.what);
        assert_eq!(
            String::from_utf8_lossy(&check.stderr),
            format!("{first}\n"),
            "{}: --check-config",
            fault.what
        );
        assert!(check.stdout.is_empty(), "{}", fault.what);
    }
    assert_name_never_owned(&dbus, &mut changes).await;
}

/// Files that are only wrong for this host: the start stops with file, line and key;
/// `--check-config` cannot know and passes them.
#[tokio::test(flavor = "multi_thread")]
async fn devices_the_host_does_not_have_stop_the_start_with_file_line_and_key() {
    let bus = PrivateBus::start();
    let (dbus, mut changes) = watch_name(&bus).await;
    for fault in HOST_FAULTS {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("rdmad.toml");
        place(&path, fault.contents);
        let out = run_rdmad(&bus, &path, fault.what).await;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{}: {stderr}", fault.what);
        let expected = format!("rdmad: {}{}", located(&path, fault), fault.message);
        assert!(
            stderr.lines().any(|l| l == expected),
            "{}: expected {expected}, got\n{stderr}",
            fault.what
        );

        let check = check_config(&path);
        assert_eq!(
            String::from_utf8_lossy(&check.stdout),
            format!("{}: configuration is valid\n", path.display()),
            "{}: {}",
            fault.what,
            String::from_utf8_lossy(&check.stderr)
        );
        assert!(check.status.success(), "{}", fault.what);
    }
    assert_name_never_owned(&dbus, &mut changes).await;
}

/// One daemon, every row (and every host fault) written over its file in turn: each
/// `Manager.Reload` is refused with InvalidArgument naming file, line and key, and the
/// configuration in force stays. Then a valid file reloads as usual.
#[tokio::test(flavor = "multi_thread")]
async fn every_invalid_config_is_refused_on_reload_and_the_old_one_stays() {
    let (bus, daemon) = start_loopback(GOOD).await;
    let connection = bus.connect().await;
    let manager = ManagerProxy::new(&connection).await.unwrap();
    let limit = |quota: &[rdmad_client::types::QuotaEntry], name: &str| {
        quota
            .iter()
            .find(|q| q.name == name)
            .map(|q| (q.limit, q.source.clone()))
            .unwrap_or_else(|| panic!("no {name} in {quota:?}"))
    };
    let before = manager.get_quota(NOBODY).await.unwrap();
    assert_eq!(
        limit(&before, "regions"),
        (7, "quota.default.regions".to_owned())
    );
    assert_eq!(
        limit(&before, "keys"),
        (5, "quota.user.nobody.keys".to_owned())
    );
    let path = &daemon.config_path;

    for fault in FAULTS.iter().chain(HOST_FAULTS) {
        place(path, fault.contents);
        let expected = located(path, fault);
        match manager.reload().await {
            Err(Error::InvalidArgument(message)) => assert!(
                message.starts_with(&expected) && message[expected.len()..].contains(fault.message),
                "{}: expected {expected}…{}…, got {message}",
                fault.what,
                fault.message
            ),
            other => panic!(
                "{}: expected org.rdmad1.Error.InvalidArgument, got {other:?}",
                fault.what
            ),
        }
        assert_eq!(manager.n_reloads().await.unwrap(), 0, "{}", fault.what);
        assert_eq!(
            manager.get_quota(NOBODY).await.unwrap(),
            before,
            "{}: the configuration in force changed",
            fault.what
        );
    }
    let log = daemon.stderr();
    assert!(
        log.contains(&format!(
            "configuration not reloaded, the previous one stays in force: {}: cannot read",
            path.display()
        )),
        "{log}"
    );

    // Still serving, and a good file still reloads.
    assert_eq!(manager.list_devices().await.unwrap().len(), 1);
    place(path, Text("[quota.default]\nregions = 9\n"));
    manager.reload().await.unwrap();
    assert_eq!(manager.n_reloads().await.unwrap(), 1);
    let after = manager.get_quota(NOBODY).await.unwrap();
    assert_eq!(
        limit(&after, "regions"),
        (9, "quota.default.regions".to_owned())
    );
    assert_eq!(limit(&after, "keys").1, "the built-in default");
}
