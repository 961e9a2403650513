//! Quota limits as they apply to one user, the check made before anything is created, and
//! the check that a quota leaves a shared pool (or a device's windows) to more than one user.

use std::fmt;

use crate::config::{ByteSize, Config, PoolConfig, QuotaKind, QuotaLimits};
pub use crate::engine::{Limit, Limits, QuotaError, Usage};

/// The user name of `uid`, or the number when it has none.
pub fn user_name(uid: u32) -> String {
    crate::lock::check_lookup("user_name");
    match nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(uid)) {
        Ok(Some(user)) => user.name,
        _ => uid.to_string(),
    }
}

/// The groups of `uid` as the system lists them (for callers whose groups the bus did not
/// report, e.g. `GetQuota` of another user).
pub fn groups_of(uid: u32) -> Vec<u32> {
    crate::lock::check_lookup("groups_of");
    match nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(uid)) {
        Ok(Some(user)) => groups_of_user(user),
        _ => Vec::new(),
    }
}

/// The groups of the user named `name` (none when there is no such user).
fn groups_of_name(name: &str) -> Vec<u32> {
    crate::lock::check_lookup("groups_of_name");
    match nix::unistd::User::from_name(name) {
        Ok(Some(user)) => groups_of_user(user),
        _ => Vec::new(),
    }
}

fn groups_of_user(user: nix::unistd::User) -> Vec<u32> {
    let Ok(name) = std::ffi::CString::new(user.name) else {
        return Vec::new();
    };
    nix::unistd::getgrouplist(&name, user.gid)
        .map(|gids| gids.into_iter().map(|g| g.as_raw()).collect())
        .unwrap_or_else(|_| vec![user.gid.as_raw()])
}

/// The limits of `uid` with groups `gids`: the user's table, else the most generous of
/// its groups' tables, else `quota.default`, else the built-in default — per key.
pub fn limits_for(config: &Config, uid: u32, gids: &[u32]) -> Limits {
    let user = user_name(uid);
    let user_table = config.quota.user.get(&user);
    let groups: Vec<(&String, &crate::config::QuotaLimits)> = config
        .quota
        .group
        .iter()
        .filter(|(name, _)| super::in_group(name, gids))
        .collect();
    let limits = QuotaKind::ALL
        .iter()
        .map(|&kind| {
            if let Some(v) = user_table.and_then(|t| t.get(kind)) {
                return Limit {
                    value: v,
                    source: format!("quota.user.{user}.{}", kind.key()),
                };
            }
            let best_group = groups
                .iter()
                .filter_map(|(name, t)| t.get(kind).map(|v| (v, *name)))
                .max_by_key(|(v, _)| *v);
            if let Some((v, name)) = best_group {
                return Limit {
                    value: v,
                    source: format!("quota.group.{name}.{}", kind.key()),
                };
            }
            match config.quota.default.get(kind) {
                Some(v) => Limit {
                    value: v,
                    source: format!("quota.default.{}", kind.key()),
                },
                None => Limit {
                    value: kind.builtin(),
                    source: "the built-in default".to_owned(),
                },
            }
        })
        .collect();
    Limits::new(user, uid, limits)
}

/// What a quota draws on: a pool's capacity in bytes, or a device's memory windows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Capacity {
    pub name: String,
    pub amount: u64,
}

/// A quota that protects nothing: its limit is not below the capacity of any pool (or
/// device) its users may draw on, so one user at the limit can take all of one, and
/// everyone else's requests there fail with `PoolExhausted` (or `DeviceError`) instead of
/// that user's with `QuotaExceeded`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OversizedQuota {
    /// `quota.default`, `quota.user.NAME`, `quota.group.NAME`, or [`BUILTIN`] when
    /// `quota.default` leaves the key unset.
    pub table: String,
    pub kind: QuotaKind,
    pub value: u64,
    /// The pools (or devices) the table's users may use, none larger than the limit.
    pub capacities: Vec<Capacity>,
}

/// The table name of a limit nothing in the configuration sets.
pub const BUILTIN: &str = "the built-in default";

impl fmt::Display for OversizedQuota {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let key = self.kind.key();
        let show = |amount: u64| match self.kind {
            QuotaKind::RegisteredBytes => ByteSize(amount).to_string(),
            _ => amount.to_string(),
        };
        let setting = if self.table == BUILTIN {
            write!(
                f,
                "{key} = {} ({BUILTIN}: quota.default.{key} is not set) ",
                show(self.value)
            )?;
            format!("quota.default.{key}")
        } else {
            write!(f, "{}.{key} = {} ", self.table, show(self.value))?;
            format!("{}.{key}", self.table)
        };
        let list = self
            .capacities
            .iter()
            .map(|c| format!("{}: {}", c.name, show(c.amount)))
            .collect::<Vec<_>>()
            .join(", ");
        match self.kind {
            QuotaKind::Exports => write!(
                f,
                "is not below the memory windows (max_mw) of any device ({list}): one user can \
                 bind them all, and everyone else's ExportRemote then fails; set {setting} to \
                 a small fraction of max_mw"
            ),
            _ => write!(
                f,
                "is not below the capacity of any pool it applies to ({list}): one user can \
                 fill a pool, and everyone else's allocations from it then get PoolExhausted; \
                 set {setting} to a fraction of the largest capacity, or enlarge the pools"
            ),
        }
    }
}

/// Who a quota table applies to, for finding the pools they may use.
enum Scope<'a> {
    Default,
    User(&'a str),
    Group(&'a str),
}

/// The pools the users of a table may allocate from. The default table applies to users
/// nothing else names, so to the pools open to everyone — or, when every pool has an
/// access list, to any of them.
fn pools_for<'p>(scope: &Scope<'_>, pools: &'p [PoolConfig]) -> Vec<&'p PoolConfig> {
    match scope {
        Scope::Default => {
            let open: Vec<&PoolConfig> = pools.iter().filter(|p| p.open_to_everyone()).collect();
            if open.is_empty() {
                pools.iter().collect()
            } else {
                open
            }
        }
        Scope::User(name) => {
            let gids = groups_of_name(name);
            pools
                .iter()
                .filter(|p| super::pool_admits(p, name, &gids))
                .collect()
        }
        Scope::Group(name) => pools
            .iter()
            .filter(|p| {
                p.open_to_everyone()
                    || p.groups.iter().any(|g| g == name)
                    || p.users
                        .iter()
                        .any(|u| super::in_group(name, &groups_of_name(u)))
            })
            .collect(),
    }
}

/// Logs one warning per quota of `config` under which one user could take a whole pool
/// `engine` serves, or every memory window of one of its devices (at start and after every
/// reload).
pub fn warn_of_oversized(config: &Config, engine: &crate::engine::Engine) {
    let (pools, windows) = engine.capacities();
    let devices: Vec<Capacity> = windows
        .into_iter()
        .map(|(name, amount)| Capacity { name, amount })
        .collect();
    for q in oversized(config, &pools, &devices) {
        tracing::warn!(table = %q.table, key = q.kind.key(), "{q}");
    }
}

/// Every quota in `config` (the built-in defaults included) that one user could use to
/// take a whole pool of `pools` (`registered_bytes`) or all the windows of a device of
/// `devices` (`exports`, against each device's max_mw).
pub fn oversized(
    config: &Config,
    pools: &[PoolConfig],
    devices: &[Capacity],
) -> Vec<OversizedQuota> {
    let q = &config.quota;
    let mut tables: Vec<(String, Scope<'_>, &QuotaLimits)> =
        vec![("quota.default".to_owned(), Scope::Default, &q.default)];
    for (name, limits) in &q.user {
        let table = format!("quota.user.{}", crate::config::key_segment(name));
        tables.push((table, Scope::User(name), limits));
    }
    for (name, limits) in &q.group {
        let table = format!("quota.group.{}", crate::config::key_segment(name));
        tables.push((table, Scope::Group(name), limits));
    }
    let mut found = Vec::new();
    for kind in [QuotaKind::RegisteredBytes, QuotaKind::Exports] {
        for (table, scope, limits) in &tables {
            let (table, value) = match (limits.get(kind), scope) {
                (Some(value), _) => (table.clone(), value),
                (None, Scope::Default) => (BUILTIN.to_owned(), kind.builtin()),
                (None, _) => continue,
            };
            let capacities: Vec<Capacity> = match kind {
                QuotaKind::RegisteredBytes => pools_for(scope, pools)
                    .into_iter()
                    .map(|p| Capacity {
                        name: p.name.clone(),
                        amount: p.capacity.0,
                    })
                    .collect(),
                _ => devices.to_vec(),
            };
            if !capacities.is_empty() && capacities.iter().all(|c| value >= c.amount) {
                found.push(OversizedQuota {
                    table,
                    kind,
                    value,
                    capacities,
                });
            }
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn config(text: &str) -> Config {
        Config::parse(Path::new("test.toml"), text).unwrap()
    }

    #[test]
    fn user_beats_group_beats_default_beats_builtin() {
        let c = config(
            "[quota.default]\nregions = 10\n[quota.group.root]\nregions = 50\nkeys = 7\n\
             [quota.user.root]\nregions = 20\n",
        );
        let root = limits_for(&c, 0, &[0]);
        assert_eq!(root.get(QuotaKind::Regions).value, 20);
        assert_eq!(
            root.get(QuotaKind::Regions).source,
            "quota.user.root.regions"
        );
        assert_eq!(root.get(QuotaKind::Keys).value, 7);
        assert_eq!(root.get(QuotaKind::Keys).source, "quota.group.root.keys");
        assert_eq!(
            root.get(QuotaKind::Sessions).value,
            QuotaKind::Sessions.builtin()
        );
        let nobody = limits_for(&c, 65534, &[65534]);
        assert_eq!(nobody.get(QuotaKind::Regions).value, 10);
        assert_eq!(
            nobody.get(QuotaKind::Regions).source,
            "quota.default.regions"
        );
    }

    /// The built-in defaults protect the built-in pool and any device: with the shipped
    /// configuration nothing is oversized, and no single user can fill the pool.
    #[test]
    fn builtin_defaults_leave_the_builtin_pool_to_more_than_one_user() {
        let shipped = Config::load(
            &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/rdmad.toml"),
        )
        .unwrap();
        let pools = shipped.effective_pools();
        let loopback = [Capacity {
            name: "loopback0".into(),
            amount: 524_287,
        }];
        assert_eq!(oversized(&shipped, &pools, &loopback), vec![]);
        assert!(QuotaKind::RegisteredBytes.builtin() * 4 <= pools[0].capacity.0);
        assert!(QuotaKind::Exports.builtin() * 500 <= loopback[0].amount);
    }

    fn capacities(list: &[(&str, u64)]) -> Vec<Capacity> {
        list.iter()
            .map(|(name, amount)| Capacity {
                name: (*name).to_owned(),
                amount: *amount,
            })
            .collect()
    }

    #[test]
    fn a_quota_one_user_can_fill_every_pool_with_is_found_and_named() {
        let c = config("[quota.default]\nregistered_bytes = \"4GiB\"\nexports = 524287\n");
        let found = oversized(
            &c,
            &c.effective_pools(),
            &capacities(&[("loopback0", 524_287)]),
        );
        assert_eq!(
            found,
            vec![
                OversizedQuota {
                    table: "quota.default".into(),
                    kind: QuotaKind::RegisteredBytes,
                    value: 4 << 30,
                    capacities: capacities(&[("default", 1 << 30)]),
                },
                OversizedQuota {
                    table: "quota.default".into(),
                    kind: QuotaKind::Exports,
                    value: 524_287,
                    capacities: capacities(&[("loopback0", 524_287)]),
                },
            ]
        );
        assert_eq!(
            found[0].to_string(),
            "quota.default.registered_bytes = 4GiB is not below the capacity of any pool it \
             applies to (default: 1GiB): one user can fill a pool, and everyone else's \
             allocations from it then get PoolExhausted; set quota.default.registered_bytes \
             to a fraction of the largest capacity, or enlarge the pools"
        );
        assert_eq!(
            found[1].to_string(),
            "quota.default.exports = 524287 is not below the memory windows (max_mw) of any \
             device (loopback0: 524287): one user can bind them all, and everyone else's \
             ExportRemote then fails; set quota.default.exports to a small fraction of max_mw"
        );
        // One below every capacity protects them.
        let c = config("[quota.default]\nregistered_bytes = 1073737728\nexports = 524286\n");
        let none = oversized(
            &c,
            &c.effective_pools(),
            &capacities(&[("loopback0", 524_287)]),
        );
        assert_eq!(none, vec![]);
    }

    /// The built-in default counts when `quota.default` leaves the key unset.
    #[test]
    fn an_unset_default_is_checked_as_the_builtin_value() {
        let c =
            config("[[pool]]\nname = \"small\"\ncapacity = \"64MiB\"\nsize_classes = [\"4KiB\"]\n");
        let found = oversized(&c, &c.effective_pools(), &[]);
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(
            found[0].to_string(),
            "registered_bytes = 256MiB (the built-in default: quota.default.registered_bytes \
             is not set) is not below the capacity of any pool it applies to (small: 64MiB): \
             one user can fill a pool, and everyone else's allocations from it then get \
             PoolExhausted; set quota.default.registered_bytes to a fraction of the largest \
             capacity, or enlarge the pools"
        );
    }

    /// `(table, [pool])` of every oversized `registered_bytes` in `c`'s own pools.
    fn tables_and_pools(c: &Config) -> Vec<(String, Vec<String>)> {
        oversized(c, &c.effective_pools(), &[])
            .into_iter()
            .map(|q| {
                let pools = q.capacities.into_iter().map(|p| p.name).collect();
                (q.table, pools)
            })
            .collect()
    }

    /// Each table is compared with the pools its users may use: a pool's access list
    /// decides, and a pool nobody under the table may use does not protect it.
    #[test]
    fn each_table_is_compared_with_the_pools_its_users_may_use() {
        let c = config(
            "[[pool]]\nname = \"shared\"\ncapacity = \"1GiB\"\nsize_classes = [\"4KiB\"]\n\n\
             [[pool]]\nname = \"rootonly\"\ncapacity = \"8GiB\"\nsize_classes = [\"4KiB\"]\n\
             users = [\"root\"]\n\n\
             [[pool]]\nname = \"rootgroup\"\ncapacity = \"16GiB\"\nsize_classes = [\"4KiB\"]\n\
             groups = [\"root\"]\n\n\
             [quota.default]\nregistered_bytes = \"2GiB\"\n\
             [quota.user.root]\nregistered_bytes = \"12GiB\"\n\
             [quota.user.nobody]\nregistered_bytes = \"12GiB\"\n\
             [quota.group.root]\nregistered_bytes = \"12GiB\"\n\
             [quota.group.nogroup]\nregistered_bytes = \"512MiB\"\n\
             [quota.user.daemon]\nregions = 10\n",
        );
        let found = tables_and_pools(&c);
        assert_eq!(
            found,
            vec![
                // The default applies to users nothing else names: the open pool.
                ("quota.default".to_owned(), vec!["shared".to_owned()]),
                // nobody may use only the open pool; root (by name and by group) all three.
                ("quota.user.nobody".to_owned(), vec!["shared".to_owned()]),
            ]
        );
        // A group's members reach the pools that name them one by one.
        let c = config(
            "[[pool]]\nname = \"rootonly\"\ncapacity = \"8GiB\"\nsize_classes = [\"4KiB\"]\n\
             users = [\"root\"]\n\
             [[pool]]\nname = \"daemononly\"\ncapacity = \"1GiB\"\nsize_classes = [\"4KiB\"]\n\
             users = [\"daemon\"]\n\
             [quota.group.root]\nregistered_bytes = \"10GiB\"\n\
             [quota.group.nogroup]\nregistered_bytes = \"10GiB\"\n",
        );
        let found = tables_and_pools(&c);
        // root, a member of group root, may use rootonly; no member of nogroup may use any
        // pool, so it has nothing to fill. Every pool has an access list, so the built-in
        // default (256MiB) is compared with all of them.
        assert_eq!(
            found,
            vec![("quota.group.root".to_owned(), vec!["rootonly".to_owned()])]
        );
    }
}
