//! `[[pool]]`: pre-registered memory that sessions allocate regions from.

use serde::Deserialize;

use super::size::ByteSize;

/// Page size regions are made of; a hugepage pool uses 2 MiB pages.
pub const PAGE: u64 = 4096;
pub const HUGEPAGE: u64 = 2 << 20;

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolConfig {
    /// Name clients allocate from (`AllocateRegion("default", …)`).
    pub name: String,
    /// The device whose protection domain registers the regions; unset: the first device.
    #[serde(default)]
    pub device: Option<String>,
    /// Most bytes the pool holds at once: allocated regions plus warm ones.
    pub capacity: ByteSize,
    /// Region sizes: a request is rounded up to the smallest class that holds it.
    #[serde(default)]
    pub size_classes: Vec<ByteSize>,
    /// Instead of size classes: requests are rounded up to a multiple of this.
    #[serde(default)]
    pub granularity: Option<ByteSize>,
    /// Back regions with 2 MiB hugepages (the host must have them reserved).
    #[serde(default)]
    pub hugepages: bool,
    /// Users who may allocate from the pool; with `groups`, empty means everyone.
    #[serde(default)]
    pub users: Vec<String>,
    /// Groups whose members may allocate from the pool.
    #[serde(default)]
    pub groups: Vec<String>,
    /// Fresh, registered regions kept ready per size class.
    #[serde(default)]
    pub warm: u32,
}

impl PoolConfig {
    /// The pool served when the configuration has no `[[pool]]`.
    pub fn builtin_default() -> PoolConfig {
        PoolConfig {
            name: "default".to_owned(),
            device: None,
            capacity: ByteSize(1 << 30),
            size_classes: [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]
                .into_iter()
                .map(ByteSize)
                .collect(),
            granularity: None,
            hugepages: false,
            users: Vec::new(),
            groups: Vec::new(),
            warm: 1,
        }
    }

    /// Whether the pool lists no users and no groups, so that everyone may use it.
    pub fn open_to_everyone(&self) -> bool {
        self.users.is_empty() && self.groups.is_empty()
    }

    pub fn page_size(&self) -> u64 {
        if self.hugepages {
            HUGEPAGE
        } else {
            PAGE
        }
    }

    /// The size a request of `size` bytes gets, or `None` if no class holds it.
    pub fn round(&self, size: u64) -> Option<u64> {
        if size == 0 {
            return None;
        }
        if let Some(ByteSize(g)) = self.granularity {
            return size
                .checked_next_multiple_of(g)
                .filter(|&s| s <= self.capacity.0);
        }
        self.size_classes.iter().map(|c| c.0).find(|&c| c >= size)
    }

    /// The largest request the pool can serve.
    pub fn largest(&self) -> u64 {
        match self.granularity {
            Some(_) => self.capacity.0,
            None => self.size_classes.last().map_or(0, |c| c.0),
        }
    }

    /// Checks the pool on its own; `i` is its index for error keys.
    pub(super) fn validate(&self, i: usize) -> Result<(), (String, String)> {
        let key = |field: &str| format!("pool[{i}].{field}");
        if self.name.is_empty() {
            return Err((key("name"), "must not be empty".into()));
        }
        if !self
            .name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        {
            return Err((
                key("name"),
                format!("{:?}: use letters, digits, '-' and '_' only", self.name),
            ));
        }
        let page = self.page_size();
        if self.capacity.0 == 0 || self.capacity.0 % page != 0 {
            return Err((
                key("capacity"),
                format!(
                    "must be a positive multiple of the page size ({})",
                    ByteSize(page)
                ),
            ));
        }
        match (self.size_classes.is_empty(), self.granularity) {
            (true, None) => {
                return Err((
                    key("size_classes"),
                    "set size_classes (e.g. [\"4KiB\", \"1MiB\"]) or granularity".into(),
                ))
            }
            (false, Some(_)) => {
                return Err((
                    key("granularity"),
                    "set either size_classes or granularity, not both".into(),
                ))
            }
            (true, Some(ByteSize(g))) => {
                if g == 0 || g % page != 0 {
                    return Err((
                        key("granularity"),
                        format!(
                            "must be a positive multiple of the page size ({})",
                            ByteSize(page)
                        ),
                    ));
                }
                if self.warm > 0 {
                    return Err((
                        key("warm"),
                        "warm regions need size_classes (a pool with granularity has none)".into(),
                    ));
                }
            }
            (false, None) => {
                for (j, class) in self.size_classes.iter().enumerate() {
                    if class.0 == 0 || class.0 % page != 0 {
                        return Err((
                            format!("pool[{i}].size_classes"),
                            format!(
                                "{class} is not a positive multiple of the page size ({})",
                                ByteSize(page)
                            ),
                        ));
                    }
                    if j > 0 && class.0 <= self.size_classes[j - 1].0 {
                        return Err((
                            key("size_classes"),
                            "size classes must be listed smallest first, without repeats".into(),
                        ));
                    }
                    if class.0 > self.capacity.0 {
                        return Err((
                            key("size_classes"),
                            format!("{class} is larger than the capacity {}", self.capacity),
                        ));
                    }
                }
                let warm_bytes: u64 =
                    self.size_classes.iter().map(|c| c.0).sum::<u64>() * u64::from(self.warm);
                if warm_bytes > self.capacity.0 {
                    return Err((
                        key("warm"),
                        format!(
                            "{} warm regions of every class need {}, more than the capacity {}",
                            self.warm,
                            ByteSize(warm_bytes),
                            self.capacity
                        ),
                    ));
                }
            }
        }
        for user in &self.users {
            if !super::user_exists(user) {
                return Err((key("users"), format!("there is no user named {user:?}")));
            }
        }
        for group in &self.groups {
            if !super::group_exists(group) {
                return Err((key("groups"), format!("there is no group named {group:?}")));
            }
        }
        Ok(())
    }
}
