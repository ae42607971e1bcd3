//! What the store writes to logs and traces: spans per claim and per owner write (operation, key tag,
//! outcome, fence), and never a key or a payload whole. A `tracing` subscriber at TRACE captures all of
//! it; real servers, both modes.

use crate::support;

use std::io::Write;
use std::sync::{Arc, Mutex, OnceLock};

use idemstore::{Begin, Fingerprint, FingerprintOptions, IdempotencyKey, Mode, Policy, RunOutcome, StoreError};
use serde_json::json;
use support::{Harness, Servers};

suite!(logs_carry_spans_and_never_a_key_or_a_payload);

/// Everything every subscriber of this process wrote.
fn captured() -> &'static Arc<Mutex<Vec<u8>>> {
    static LOGS: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    LOGS.get_or_init(|| {
        let logs = Arc::new(Mutex::new(Vec::new()));
        let writer = Capture(Arc::clone(&logs));
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::TRACE)
            .with_span_events(tracing_subscriber::fmt::format::FmtSpan::CLOSE)
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .finish();
        tracing::subscriber::set_global_default(subscriber).expect("the only subscriber");
        logs
    })
}

#[derive(Clone)]
struct Capture(Arc<Mutex<Vec<u8>>>);

impl Write for Capture {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("logs").extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A run that executes, a replay, a mismatch and a stale owner's failed completion: the spans say which
/// operation, outcome and fence, and the key and the payload never appear (only an 8-digit key tag).
async fn logs_carry_spans_and_never_a_key_or_a_payload(mode: Mode) {
    // Its subscriber is the process's: under `cargo test`, not every other test's logs too.
    if support::rerun_alone(mode, module_path!(), "logs_carry_spans_and_never_a_key_or_a_payload") {
        return;
    }
    let logs = captured();
    let h = Harness::with(mode, Policy::default(), Servers::Any).await;
    let (scope, secret) = (h.scope("acme"), format!("key-SECRET-{}", h.id()));
    let key = IdempotencyKey::new(&secret).expect("key");
    let payload = json!({"card": "PAYLOAD-SECRET-4242"});
    for _ in 0..2 {
        let outcome = h.store.run_once(&scope, &key, &payload, || async { Ok::<_, StoreError>(json!(1)) }).await;
        assert!(matches!(outcome, Ok(RunOutcome::Executed(_) | RunOutcome::Replayed(_))));
    }
    let other = json!({"card": "PAYLOAD-SECRET-0000"});
    let mismatch = h.store.run_once(&scope, &key, &other, || async { Ok::<_, StoreError>(json!(2)) }).await;
    assert!(matches!(mismatch, Ok(RunOutcome::Mismatch)));
    let fp = Fingerprint::of_serialize(&payload, &FingerprintOptions::default()).expect("fp");
    let stale_key = IdempotencyKey::new(format!("{secret}-stale")).expect("key");
    let Begin::Acquired(owner) = h.store.begin(&scope, &stale_key, &fp).await.expect("begin") else { panic!() };
    h.pass_lease(&scope, &stale_key).await;
    let Begin::Acquired(next) = h.store.begin(&scope, &stale_key, &fp).await.expect("takeover") else { panic!() };
    assert!(matches!(owner.complete(b"late").await, Err(StoreError::LeaseLost { .. })));
    next.complete(b"1").await.expect("complete");

    let text = String::from_utf8_lossy(&logs.lock().expect("logs")).into_owned();
    let operation = format!("operation=\"{}\"", h.operation);
    for wanted in ["idemstore.claim", "outcome=\"executed\"", "outcome=\"replayed\"", "outcome=\"mismatch\"", "fence="]
    {
        assert!(text.contains(wanted), "no {wanted} in the logs:\n{text}");
    }
    assert!(text.contains("idemstore.complete") && text.contains(&operation), "{text}");
    assert!(!text.contains("SECRET"), "a key or a payload was logged:\n{text}");
}
