//! Who may do what. Pure logic over the caller's identity (taken from the bus, never from
//! arguments) and the configuration; tested without a bus.

pub mod keys;
pub mod lookups;
pub mod quota;

use crate::config::{Config, PoolConfig};

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

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PolicyError {
    #[error("{action} needs administrator rights: run it as root{hint}")]
    NotAdmin { action: String, hint: String },
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
    lookups::check("in_group");
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
