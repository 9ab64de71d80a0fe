//! The `orca-push` binary.

/// mimalloc rather than glibc's malloc: a send allocates and frees many small buffers across the
/// runtime's threads, and glibc's arenas spent a fifth of the request threads' time in
/// `malloc`/`free` and their consolidation (profiled under the admission benchmark).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    orca_push::cli::main()
}
