//! The `orca-push` binary.

fn main() -> std::process::ExitCode {
    orca_push::cli::main()
}
