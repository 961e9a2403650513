//! The process's own mappings, from `/proc/self/maps`: what `ibv_reg_mr` checks before it
//! re-backs a range (docs/verbs.md, "The program's own memory").

/// One line of `/proc/self/maps`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mapping {
    pub start: usize,
    pub end: usize,
    pub read: bool,
    pub write: bool,
    pub exec: bool,
    /// `p` (copy-on-write) rather than `s` (shared).
    pub private: bool,
    pub inode: u64,
    pub path: String,
}

/// Parses `/proc/self/maps`; lines it cannot read are left out.
pub fn parse(text: &str) -> Vec<Mapping> {
    text.lines().filter_map(parse_line).collect()
}

fn parse_line(line: &str) -> Option<Mapping> {
    let mut fields = line.split_whitespace();
    let (start, end) = fields.next()?.split_once('-')?;
    let perms = fields.next()?.as_bytes();
    let _offset = fields.next()?;
    let _device = fields.next()?;
    let inode = fields.next()?.parse().ok()?;
    let path = fields.collect::<Vec<_>>().join(" ");
    if perms.len() < 4 {
        return None;
    }
    Some(Mapping {
        start: usize::from_str_radix(start, 16).ok()?,
        end: usize::from_str_radix(end, 16).ok()?,
        read: perms[0] == b'r',
        write: perms[1] == b'w',
        exec: perms[2] == b'x',
        private: perms[3] == b'p',
        inode,
        path,
    })
}

/// The protection every page of `[start, end)` has, if the range is mapped without gaps
/// by private mappings that all allow reading and agree on writing and executing; else
/// why it cannot be re-backed.
pub fn private_range(maps: &[Mapping], start: usize, end: usize) -> Result<(bool, bool), String> {
    let mut at = start;
    let mut prot = None;
    for m in maps.iter().filter(|m| m.end > start && m.start < end) {
        if m.start > at {
            return Err(format!("{at:#x} is not mapped"));
        }
        if !m.private {
            return Err(format!(
                "{:#x}..{:#x} is a shared mapping{}: only private memory (heap, stack, \
                 anonymous or private file mappings) can be registered",
                m.start,
                m.end,
                if m.path.is_empty() {
                    String::new()
                } else {
                    format!(" of {}", m.path)
                }
            ));
        }
        if !m.read {
            return Err(format!("{:#x}..{:#x} is not readable", m.start, m.end));
        }
        let this = (m.write, m.exec);
        if prot.is_some_and(|p| p != this) {
            return Err(format!(
                "{start:#x}..{end:#x} spans pages with different protections"
            ));
        }
        prot = Some(this);
        at = m.end;
        if at >= end {
            break;
        }
    }
    if at < end {
        return Err(format!("{at:#x} is not mapped"));
    }
    prot.ok_or_else(|| format!("{start:#x} is not mapped"))
}

/// Whether `[start, end)` is still mapped, as one piece, from the file with `inode`.
pub fn still_backed(maps: &[Mapping], start: usize, end: usize, inode: u64) -> bool {
    let mut at = start;
    for m in maps.iter().filter(|m| m.end > start && m.start < end) {
        if m.start > at || m.inode != inode || m.private {
            return false;
        }
        at = m.end;
    }
    at >= end
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAPS: &str = "\
55d0c0a00000-55d0c0a21000 rw-p 00000000 00:00 0                          [heap]
7f0000000000-7f0000002000 rw-s 00000000 00:01 4242                       /memfd:rdmad-region (deleted)
7f0000002000-7f0000004000 r--p 00000000 08:01 77                         /usr/lib/x.so
7f0000004000-7f0000006000 rw-p 00000000 00:00 0
7ffc00000000-7ffc00021000 rw-p 00000000 00:00 0                          [stack]
";

    #[test]
    fn private_readable_ranges_can_be_rebacked() {
        let maps = parse(MAPS);
        assert_eq!(maps.len(), 5);
        assert_eq!(maps[1].path, "/memfd:rdmad-region (deleted)");
        assert_eq!(
            private_range(&maps, 0x55d0c0a01000, 0x55d0c0a03000),
            Ok((true, false))
        );
        assert_eq!(
            private_range(&maps, 0x7ffc00000000, 0x7ffc00001000),
            Ok((true, false))
        );
        assert_eq!(
            private_range(&maps, 0x7f0000002000, 0x7f0000003000),
            Ok((false, false))
        );
    }

    #[test]
    fn holes_shared_and_mixed_ranges_are_refused() {
        let maps = parse(MAPS);
        let err = private_range(&maps, 0x55d0c0a20000, 0x55d0c0a22000).unwrap_err();
        assert_eq!(err, "0x55d0c0a21000 is not mapped");
        let err = private_range(&maps, 0x7f0000000000, 0x7f0000001000).unwrap_err();
        assert!(
            err.contains("shared mapping of /memfd:rdmad-region"),
            "{err}"
        );
        let err = private_range(&maps, 0x7f0000003000, 0x7f0000005000).unwrap_err();
        assert!(err.contains("different protections"), "{err}");
        assert!(private_range(&maps, 0x1000, 0x2000).is_err());
    }

    #[test]
    fn a_backing_is_recognised_by_its_inode() {
        let maps = parse(MAPS);
        assert!(still_backed(&maps, 0x7f0000000000, 0x7f0000002000, 4242));
        assert!(!still_backed(&maps, 0x7f0000000000, 0x7f0000003000, 4242));
        assert!(!still_backed(&maps, 0x7f0000000000, 0x7f0000002000, 4243));
    }
}
