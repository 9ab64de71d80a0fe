// sqlx::migrate! embeds the migrations when the crate compiles; rebuild it when one is added or
// changed, which cargo would not notice on its own.
fn main() {
    println!("cargo:rerun-if-changed=../../migrations/queue");
}
