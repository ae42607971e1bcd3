//! How many rounds a benchmark runs: the flags the simple benches share.

/// `--quick` (CI's smoke run), `--rounds N`, and cargo's own `--bench`: without it (`cargo test`) a run
/// is a quick one.
#[derive(clap::Args, Debug)]
pub struct Repeat {
    /// A smoke run: the fewest rounds that exercise every cell.
    #[arg(long)]
    quick: bool,
    /// Rounds per cell.
    #[arg(long)]
    rounds: Option<usize>,
    /// Passed by `cargo bench`.
    #[arg(long, hide = true)]
    bench: bool,
}

impl Repeat {
    /// The rounds asked for: `--rounds`, else `quick` for a smoke run, else `full`.
    pub fn rounds(&self, quick: usize, full: usize) -> usize {
        self.rounds.unwrap_or(if self.quick || !self.bench { quick } else { full })
    }
}
