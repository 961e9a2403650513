//! `[listen]`: who may listen for connections by address (`Session.Listen`) on which ports.
//! rdma_cm's TCP port space is its own, apart from TCP's; as with TCP's privileged ports,
//! the low ports are kept from ordinary users unless granted.

use serde::Deserialize;

/// `[listen]`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListenConfig {
    /// Ports every user may listen on: `"N"` or `"N-M"`.
    #[serde(default = "default_open_ports")]
    pub open_ports: Vec<String>,
    /// `[[listen.grant]]`: further ports for some users or groups.
    #[serde(default, rename = "grant")]
    pub grants: Vec<ListenGrant>,
}

/// `[[listen.grant]]`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListenGrant {
    pub ports: Vec<String>,
    #[serde(default)]
    pub users: Vec<String>,
    #[serde(default)]
    pub groups: Vec<String>,
}

fn default_open_ports() -> Vec<String> {
    vec!["1024-65535".to_owned()]
}

impl Default for ListenConfig {
    fn default() -> Self {
        ListenConfig {
            open_ports: default_open_ports(),
            grants: Vec::new(),
        }
    }
}

/// A port range as written: `"7471"` or `"18515-18520"`.
pub fn parse_ports(text: &str) -> Result<(u16, u16), String> {
    let port = |s: &str| {
        s.trim()
            .parse::<u16>()
            .ok()
            .filter(|p| *p > 0)
            .ok_or_else(|| format!("{s:?} is not a port (1 to 65535)"))
    };
    match text.split_once('-') {
        None => port(text).map(|p| (p, p)),
        Some((a, b)) => {
            let (a, b) = (port(a)?, port(b)?);
            if a > b {
                return Err(format!(
                    "{text:?} is an empty range: write the lower port first"
                ));
            }
            Ok((a, b))
        }
    }
}

fn in_any(list: &[String], port: u16) -> bool {
    list.iter()
        .filter_map(|r| parse_ports(r).ok())
        .any(|(a, b)| (a..=b).contains(&port))
}

impl ListenConfig {
    pub(super) fn validate(&self) -> Result<(), (String, String)> {
        for r in &self.open_ports {
            parse_ports(r).map_err(|m| ("listen.open_ports".to_owned(), m))?;
        }
        for (g, grant) in self.grants.iter().enumerate() {
            for r in &grant.ports {
                parse_ports(r).map_err(|m| (format!("listen.grant[{g}].ports"), m))?;
            }
            if grant.users.is_empty() && grant.groups.is_empty() {
                return Err((
                    format!("listen.grant[{g}]"),
                    "a grant names users or groups (ports for everyone go in listen.open_ports)"
                        .into(),
                ));
            }
            crate::lock::check_lookup("listen.grant");
            for user in &grant.users {
                if !matches!(nix::unistd::User::from_name(user), Ok(Some(_))) {
                    return Err((
                        format!("listen.grant[{g}].users"),
                        format!("there is no user named {user:?}"),
                    ));
                }
            }
            for group in &grant.groups {
                if !matches!(nix::unistd::Group::from_name(group), Ok(Some(_))) {
                    return Err((
                        format!("listen.grant[{g}].groups"),
                        format!("there is no group named {group:?}"),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Whether `port` is open to every user.
    pub fn is_open(&self, port: u16) -> bool {
        in_any(&self.open_ports, port)
    }

    /// The grants that include `port`.
    pub fn grants_for(&self, port: u16) -> impl Iterator<Item = &ListenGrant> {
        self.grants.iter().filter(move |g| in_any(&g.ports, port))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn port_ranges_parse_and_refuse_nonsense() {
        assert_eq!(parse_ports("7471"), Ok((7471, 7471)));
        assert_eq!(parse_ports("1024-65535"), Ok((1024, 65535)));
        assert!(parse_ports("0").is_err());
        assert!(parse_ports("70000").is_err());
        assert!(parse_ports("20-10")
            .unwrap_err()
            .contains("lower port first"));
        let c = ListenConfig::default();
        assert!(c.is_open(7471) && c.is_open(65535) && !c.is_open(1023));
    }
}
