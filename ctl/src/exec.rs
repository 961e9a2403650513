//! `rdmactl exec -- PROGRAM ARGS…`: runs a verbs program with rdmad's libibverbs.

use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// Environment variable naming the directory that holds rdmad's `libibverbs.so.1`
/// (overrides the places [`library_dirs`] lists).
pub const VERBS_DIR_ENV: &str = "RDMAD_VERBS_DIR";
/// Where the packages install it.
pub const INSTALLED_DIR: &str = "/usr/lib/rdmad/verbs";

/// Where rdmad's libibverbs may be, in order: `RDMAD_VERBS_DIR`, `rdmad-verbs/` next to
/// this executable (a build tree: the verbs crate's build links it there), the packages'
/// directory.
fn library_dirs() -> Vec<PathBuf> {
    if let Some(dir) = std::env::var_os(VERBS_DIR_ENV) {
        return vec![PathBuf::from(dir)];
    }
    let mut dirs = Vec::new();
    if let Some(dir) = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(|d| d.join("rdmad-verbs")))
    {
        dirs.push(dir);
    }
    dirs.push(PathBuf::from(INSTALLED_DIR));
    dirs
}

fn library_dir() -> Result<PathBuf, String> {
    let dirs = library_dirs();
    let mut unreachable = Vec::new();
    for dir in &dirs {
        let library = dir.join("libibverbs.so.1");
        // Opened, not just looked at: the dynamic loader must read it as this user.
        match std::fs::File::open(&library) {
            Ok(_) => return Ok(dir.clone()),
            Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
                unreachable.push(library.display().to_string())
            }
            Err(_) => {}
        }
    }
    if !unreachable.is_empty() {
        return Err(format!(
            "rdmad's verbs library is there but this user cannot read it: {} (permission \
             denied: a directory above it, or the file, is closed to this user)",
            unreachable.join(", ")
        ));
    }
    let tried: Vec<_> = dirs.iter().map(|d| d.display().to_string()).collect();
    Err(format!(
        "rdmad's verbs library is not installed: no libibverbs.so.1 in {} (install the \
         rdmad package, or set {VERBS_DIR_ENV} to the directory that holds it)",
        tried.join(" or ")
    ))
}

/// `LD_LIBRARY_PATH` with `dir` first.
fn library_path(dir: &Path, old: Option<OsString>) -> OsString {
    let mut path = dir.as_os_str().to_owned();
    if let Some(old) = old.filter(|o| !o.is_empty()) {
        path.push(":");
        path.push(old);
    }
    path
}

/// Replaces this process with the program; returns only if it cannot be run (exit status
/// 127 if it is not found, 126 otherwise, as env(1) does).
pub fn exec(bus: &str, command: &[OsString]) -> ExitCode {
    let dir = match library_dir() {
        Ok(dir) => dir,
        Err(e) => {
            eprintln!("rdmactl exec: {e}");
            return ExitCode::from(126);
        }
    };
    let (program, args) = command.split_first().expect("clap requires a program");
    let mut cmd = std::process::Command::new(program);
    cmd.args(args)
        .env(
            "LD_LIBRARY_PATH",
            library_path(&dir, std::env::var_os("LD_LIBRARY_PATH")),
        )
        .env(rdmad_client::names::BUS_ADDRESS_ENV, bus);
    let error = cmd.exec();
    eprintln!(
        "rdmactl exec: cannot run {}: {error}",
        Path::new(program).display()
    );
    ExitCode::from(if error.kind() == std::io::ErrorKind::NotFound {
        127
    } else {
        126
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_library_comes_first_on_the_path() {
        let dir = Path::new("/usr/lib/rdmad/verbs");
        assert_eq!(library_path(dir, None), "/usr/lib/rdmad/verbs");
        assert_eq!(library_path(dir, Some("".into())), "/usr/lib/rdmad/verbs");
        assert_eq!(
            library_path(dir, Some("/opt/lib".into())),
            "/usr/lib/rdmad/verbs:/opt/lib"
        );
    }
}
