//! `rdmad`: parse the command line, set up logging, run the daemon.

#![deny(unsafe_code)]

use clap::Parser;

fn main() -> std::process::ExitCode {
    let args = rdmad::cli::Args::parse();
    match rdmad::service::run(args) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // On stderr, which systemd also puts in the journal: logging may not be up yet
            // (a bad configuration is found before it starts).
            eprintln!("rdmad: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
