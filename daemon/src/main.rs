//! `rdmad`: parse the command line, set up logging, run the daemon.

use clap::Parser;

fn main() -> std::process::ExitCode {
    let args = rdmad::cli::Args::parse();
    match rdmad::service::run(args) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // Logging may not be up yet (bad config), so say it on stderr as well.
            tracing::error!("{e:#}");
            eprintln!("rdmad: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
