//! `orca-push`, built for the end-to-end tests.

fn main() -> std::process::ExitCode {
    orca_push::cli::main()
}
