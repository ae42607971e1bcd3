//! The binary's usage, without servers (the commands are tested against real ones in the workspace's
//! integration suite, `tests/ops.rs`). An integration test of this package also makes `cargo test` and
//! `cargo nextest run` build `idemctl` itself, which that suite runs.

use std::process::Command;

#[test]
fn every_command_is_listed_and_bad_usage_exits_2() {
    let help = Command::new(env!("CARGO_BIN_EXE_idemctl")).arg("--help").output().expect("run idemctl");
    assert!(help.status.success(), "{help:?}");
    let text = String::from_utf8_lossy(&help.stdout);
    for command in ["migrate", "inspect", "purge", "recover", "resolve", "stats", "evict", "outbox"] {
        assert!(text.contains(command), "{command} missing from:\n{text}");
    }
    let bad = Command::new(env!("CARGO_BIN_EXE_idemctl")).arg("no-such-command").output().expect("run idemctl");
    assert_eq!(bad.status.code(), Some(2), "{bad:?}");
}
