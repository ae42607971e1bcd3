//! The order of a round's subjects: how every benchmark here keeps drift from favouring one subject.

/// `subjects` in the order of round `round` of `rounds`: each round starts a further share of the list
/// along (at least one place), so that no subject always runs first or last (the rates of a round can
/// drift as its tables grow and the machine warms).
pub fn round_order<T>(mut subjects: Vec<T>, round: usize, rounds: usize) -> Vec<T> {
    let count = subjects.len();
    if count > 0 {
        let step = (count / rounds.max(1)).max(1);
        subjects.rotate_left(round * step % count);
    }
    subjects
}
