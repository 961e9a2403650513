//! The configuration parser and validator on arbitrary text, as `rdmad --check-config`
//! and `rdmactl reload` see it. Beyond "no panic": an error points at a line that exists
//! (or at the file as a whole, line 0), and names a key whenever it names a line.
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use rdmad::config::Config;

fuzz_target!(|data: &[u8]| {
    let Ok(source) = std::str::from_utf8(data) else {
        return;
    };
    let path = Path::new("/etc/rdmad/rdmad.toml");
    match Config::parse(path, source) {
        Ok(config) => {
            // Whatever is accepted is usable: the effective pools resolve.
            let _ = config.effective_pools();
        }
        Err(e) => {
            assert_eq!(e.file, path);
            let lines = source.lines().count().max(1);
            assert!(e.line <= lines + 1, "line {} of {lines}: {e}", e.line);
            assert!(!e.message.is_empty(), "{e}");
            let shown = e.to_string();
            assert!(shown.starts_with("/etc/rdmad/rdmad.toml"), "{shown}");
        }
    }
});
