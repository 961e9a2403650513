//! `rdmactl`: look at and steer rdmad, in the style of iproute2's `rdma` tool.

mod cli;
mod commands;
mod exec;
mod output;

use clap::{CommandFactory, Parser};

fn main() -> std::process::ExitCode {
    // Hidden `rdmactl completions bash|zsh|fish|elvish|powershell`: prints the completion
    // script (the packages install the ones packaging/ generates with it).
    let args: Vec<_> = std::env::args_os().skip(1).collect();
    if args.len() == 2 && args[0] == "completions" {
        let Some(shell) = args[1]
            .to_str()
            .and_then(|s| s.parse::<clap_complete::Shell>().ok())
        else {
            eprintln!("rdmactl: completions: SHELL is bash, zsh, fish, elvish or powershell");
            return std::process::ExitCode::FAILURE;
        };
        clap_complete::generate(
            shell,
            &mut cli::Cli::command(),
            "rdmactl",
            &mut std::io::stdout(),
        );
        return std::process::ExitCode::SUCCESS;
    }
    let cli = cli::Cli::parse();
    if let cli::Object::Exec { command } = &cli.object {
        // Only returns if the program could not be run.
        return exec::exec(&cli.bus, command);
    }
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
