//! The cost of fingerprinting a request: canonical JSON plus SHA-256, in bytes per second, for payloads
//! of 200 B, 4 KiB and 64 KiB (`cargo bench --bench fingerprint`).

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use idemstore::{Fingerprint, FingerprintOptions};
use serde_json::json;

/// A payment-like JSON document of about `size` bytes: nested objects, numbers, strings, an array.
fn payload(size: usize) -> Vec<u8> {
    let mut items = Vec::new();
    let mut doc = json!({});
    while serde_json::to_vec(&doc).map_or(0, |d| d.len()) < size {
        let n = items.len();
        items.push(
            json!({"sku": format!("sku-{n:05}"), "quantity": n % 7 + 1, "price": 12.5 + n as f64, "tags": ["a", "b"]}),
        );
        doc = json!({"amount": 1200, "currency": "EUR", "customer": {"id": "cus_1", "email": "a@example.com"}, "items": items});
    }
    serde_json::to_vec(&doc).unwrap_or_default()
}

fn fingerprint(c: &mut Criterion) {
    let options = FingerprintOptions::default();
    let mut group = c.benchmark_group("fingerprint");
    for (name, size) in [("200B", 200), ("4KiB", 4 << 10), ("64KiB", 64 << 10)] {
        let body = payload(size);
        group.throughput(Throughput::Bytes(body.len() as u64));
        group.bench_function(format!("json/{name}"), |b| b.iter(|| Fingerprint::of_json(&body, &options)));
        group.bench_function(format!("raw/{name}"), |b| b.iter(|| Fingerprint::of_bytes(&body, &options)));
    }
    group.finish();
}

criterion_group!(benches, fingerprint);
criterion_main!(benches);
