//! `rdmactl`: look at and steer rdmad, in the style of iproute2's `rdma` tool.

mod cli;
mod commands;
mod output;

use clap::Parser;

fn main() -> std::process::ExitCode {
    let cli = cli::Cli::parse();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("rdmactl: cannot start: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match runtime.block_on(commands::run(&cli)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rdmactl: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
