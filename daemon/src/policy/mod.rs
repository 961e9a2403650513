//! Who may do what. Pure logic over the caller's identity (taken from the bus, never from
//! arguments) and the configuration, tested without a bus. It turns a caller into the plain
//! inputs the engine takes: an [`Owner`], the [`Limits`] in force, a [`Scope`] and the
//! [`PoolAccess`]. User and group lookups (NSS) happen here, never inside the engine.

pub mod quota;

use crate::config::{Config, PoolConfig};
use crate::engine::{Limits, Owner, PoolAccess, Scope};

/// The identity of a D-Bus caller, as the bus daemon vouches for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    /// Unique bus name (`:1.42`).
    pub bus_name: String,
    pub uid: u32,
    /// Primary and supplementary groups.
    pub gids: Vec<u32>,
    pub pid: Option<u32>,
}

impl Caller {
    /// The owner of what this caller makes: its user and its connection.
    pub fn owner(&self) -> Owner {
        Owner {
            uid: self.uid,
            connection: self.bus_name.clone(),
            pid: self.pid,
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PolicyError {
    #[error("{action} needs administrator rights: run it as root{hint}")]
    NotAdmin { action: String, hint: String },
    #[error("only administrators may read another user's quota")]
    OthersQuota,
}

/// Whose objects `caller` may see, close and revoke: everyone's for an administrator, its
/// user's otherwise.
pub fn scope(caller: &Caller, config: &Config) -> Scope {
    if is_admin(caller, config) {
        Scope::All
    } else {
        Scope::Own
    }
}

/// The quota limits in force for `caller`.
pub fn limits(caller: &Caller, config: &Config) -> Limits {
    quota::limits_for(config, caller.uid, &caller.gids)
}

/// The limits of user `uid` for `caller` to read: its own, or anyone's for an
/// administrator.
pub fn limits_of(caller: &Caller, config: &Config, uid: u32) -> Result<Limits, PolicyError> {
    if uid == caller.uid {
        return Ok(limits(caller, config));
    }
    if !is_admin(caller, config) {
        return Err(PolicyError::OthersQuota);
    }
    Ok(quota::limits_for(config, uid, &quota::groups_of(uid)))
}

/// Which of `pools` (those the engine serves, as configured when it started) `caller` may
/// allocate from and attach regions of; each refused one with a reason that names who may
/// use it.
pub fn pool_access(caller: &Caller, pools: &[PoolConfig]) -> PoolAccess {
    let mut access = PoolAccess::everywhere();
    let restricted: Vec<&PoolConfig> = pools.iter().filter(|p| !p.open_to_everyone()).collect();
    if restricted.is_empty() {
        return access;
    }
    let user = quota::user_name(caller.uid);
    for c in restricted {
        if pool_admits(c, &user, &caller.gids) {
            continue;
        }
        let list = |names: &[String]| {
            if names.is_empty() {
                "none".to_owned()
            } else {
                names.join(", ")
            }
        };
        access.refuse(
            &c.name,
            format!(
                "user {user} may not use pool {:?} (allowed users: {}; groups: {})",
                c.name,
                list(&c.users),
                list(&c.groups),
            ),
        );
    }
    access
}

/// Root is always an administrator; so are members of `daemon.admin_group`.
pub fn is_admin(caller: &Caller, config: &Config) -> bool {
    if caller.uid == 0 {
        return true;
    }
    let Some(group) = &config.daemon.admin_group else {
        return false;
    };
    in_group(group, &caller.gids)
}

/// Whether `gids` include the group named `group` (false when there is no such group;
/// a failed lookup is logged and denies).
pub fn in_group(group: &str, gids: &[u32]) -> bool {
    crate::lock::check_lookup("in_group");
    match nix::unistd::Group::from_name(group) {
        Ok(Some(g)) => gids.contains(&g.gid.as_raw()),
        Ok(None) => false,
        Err(e) => {
            tracing::warn!("cannot look up group {group:?}: {e}");
            false
        }
    }
}

/// Whether a pool's access list lets user `user` with groups `gids` allocate from it:
/// everyone when it lists no users and no groups.
pub fn pool_admits(pool: &PoolConfig, user: &str, gids: &[u32]) -> bool {
    pool.open_to_everyone()
        || pool.users.iter().any(|u| u == user)
        || pool.groups.iter().any(|g| in_group(g, gids))
}

/// Whether `caller` may listen for connections by address on `port`: administrators on
/// any; others on `listen.open_ports` and on the ports a `[[listen.grant]]` gives their
/// user or one of their groups. The error says which ports are open and how to get more.
pub fn may_listen(caller: &Caller, config: &Config, port: u16) -> Result<(), String> {
    let listen = &config.listen;
    if is_admin(caller, config) || listen.is_open(port) {
        return Ok(());
    }
    let user = quota::user_name(caller.uid);
    let granted = listen
        .grants_for(port)
        .any(|g| g.users.contains(&user) || g.groups.iter().any(|grp| in_group(grp, &caller.gids)));
    if granted {
        return Ok(());
    }
    Err(format!(
        "user {user} may not listen on port {port}: open to every user are {}; an \
         administrator grants more with a [[listen.grant]] table in the configuration",
        listen.open_ports.join(", ")
    ))
}

/// Fails with a message saying how to get the right, unless `caller` is an administrator.
pub fn require_admin(caller: &Caller, config: &Config, action: &str) -> Result<(), PolicyError> {
    if is_admin(caller, config) {
        return Ok(());
    }
    let hint = match &config.daemon.admin_group {
        Some(group) => format!(" or as a member of group {group:?}"),
        None => " (or set daemon.admin_group in the configuration)".to_owned(),
    };
    Err(PolicyError::NotAdmin {
        action: action.to_owned(),
        hint,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caller(uid: u32, gids: &[u32]) -> Caller {
        Caller {
            bus_name: ":1.1".into(),
            uid,
            gids: gids.to_vec(),
            pid: None,
        }
    }

    fn config_with_admin_group(group: Option<&str>) -> Config {
        let mut config = Config::default();
        config.daemon.admin_group = group.map(str::to_owned);
        config
    }

    #[test]
    fn root_is_always_admin() {
        assert!(is_admin(&caller(0, &[]), &Config::default()));
    }

    #[test]
    fn admin_group_members_are_admins_and_others_are_not() {
        // gid 0 ("root") exists everywhere; use it as the admin group.
        let config = config_with_admin_group(Some("root"));
        assert!(is_admin(&caller(1000, &[100, 0]), &config));
        assert!(!is_admin(&caller(1000, &[100]), &config));
        assert!(!is_admin(&caller(1000, &[0]), &Config::default()));
    }

    #[test]
    fn refusal_says_how_to_get_the_right() {
        let err = require_admin(&caller(1000, &[]), &Config::default(), "Reload").unwrap_err();
        assert_eq!(
            err.to_string(),
            "Reload needs administrator rights: run it as root (or set daemon.admin_group in the configuration)"
        );
        let config = config_with_admin_group(Some("root"));
        let err = require_admin(&caller(1000, &[]), &config, "Reload").unwrap_err();
        assert!(
            err.to_string()
                .ends_with("or as a member of group \"root\""),
            "{err}"
        );
    }
}
