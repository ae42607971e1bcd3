//! Webhook signature checks on their own (no servers): each way a delivery is refused, secret rotation,
//! and a property: any changed byte of the body, the event id or the timestamp is refused.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use idemstore::inbox::VerifiedDelivery;
use idemstore::{ConfigError, SignatureError, SignatureScheme, WebhookVerifier};
use proptest::prelude::*;

const SCHEMES: [SignatureScheme; 2] = [SignatureScheme::Stripe, SignatureScheme::StandardWebhooks];
const NOW: u64 = 1_764_547_200;

fn at(seconds: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(seconds)
}

fn verifier(scheme: SignatureScheme, secrets: &[&str]) -> WebhookVerifier {
    WebhookVerifier::new(scheme, secrets.iter().copied()).expect("verifier")
}

fn verify(
    verifier: &WebhookVerifier,
    headers: &[(&'static str, String)],
    body: &[u8],
    now: u64,
) -> Result<VerifiedDelivery, SignatureError> {
    let pairs: Vec<(&str, &str)> = headers.iter().map(|(name, value)| (*name, value.as_str())).collect();
    verifier.verify_at(pairs.as_slice(), body, at(now))
}

fn body(id: &str) -> Vec<u8> {
    format!(r#"{{"id":"{id}","type":"charge.succeeded","data":{{"amount":1200}}}}"#).into_bytes()
}

#[test]
fn a_signed_delivery_verifies_and_names_its_signed_event() {
    for scheme in SCHEMES {
        let verifier = verifier(scheme, &["whsec_c2VjcmV0LW9uZQ"]);
        let headers = verifier.sign("evt_1", at(NOW), &body("evt_1"));
        let delivery = verify(&verifier, &headers, &body("evt_1"), NOW + 10).expect("verifies");
        assert_eq!((delivery.event_id.as_str(), delivery.signed_at), ("evt_1", at(NOW)), "{scheme:?}");
    }
}

#[test]
fn a_rotated_secret_verifies_while_it_is_listed_and_not_after() {
    for scheme in SCHEMES {
        let old = verifier(scheme, &["whsec_b2xkLXNlY3JldA"]);
        let headers = old.sign("evt_1", at(NOW), &body("evt_1"));
        let rotating = verifier(scheme, &["whsec_bmV3LXNlY3JldA", "whsec_b2xkLXNlY3JldA"]);
        assert!(verify(&rotating, &headers, &body("evt_1"), NOW).is_ok(), "{scheme:?}: old secret still listed");
        let rotated = verifier(scheme, &["whsec_bmV3LXNlY3JldA"]);
        let refused = verify(&rotated, &headers, &body("evt_1"), NOW);
        assert!(matches!(refused, Err(SignatureError::Mismatch)), "{scheme:?}: {refused:?}");
    }
}

/// Several signatures in one header (the provider signs with both secrets while it rotates): any one
/// matching an active secret is enough.
#[test]
fn one_matching_signature_among_several_is_enough() {
    let verifier = verifier(SignatureScheme::Stripe, &["whsec_current"]);
    let signed = verifier.sign("evt_1", at(NOW), &body("evt_1"));
    let (t, v1) = signed[0].1.split_once(',').expect("t and v1");
    let header = format!("{t},v1={},{v1},v0=ignored", "ab".repeat(32));
    assert!(verify(&verifier, &[("stripe-signature", header)], &body("evt_1"), NOW).is_ok());

    let verifier = self::verifier(SignatureScheme::StandardWebhooks, &["whsec_Y3VycmVudA"]);
    let mut signed = verifier.sign("msg_1", at(NOW), b"{}");
    signed[2].1 = format!("v1a,c29tZXRoaW5n v1,AAAA {}", signed[2].1);
    assert!(verify(&verifier, &signed, b"{}", NOW).is_ok());
}

#[test]
fn the_timestamp_tolerance_holds_both_ways() {
    for scheme in SCHEMES {
        let verifier = verifier(scheme, &["whsec_c2VjcmV0"]).tolerance(Duration::from_secs(60));
        let headers = verifier.sign("evt_1", at(NOW), &body("evt_1"));
        for (now, accepted) in [(NOW - 60, true), (NOW + 60, true), (NOW - 61, false), (NOW + 61, false)] {
            let answer = verify(&verifier, &headers, &body("evt_1"), now);
            assert_eq!(answer.is_ok(), accepted, "{scheme:?} at {now}: {answer:?}");
            if let Err(refused) = answer {
                assert!(matches!(refused, SignatureError::Stale { .. }) && refused.is_unauthorized());
            }
        }
    }
}

#[test]
fn missing_or_garbled_headers_are_malformed_not_unauthorized() {
    let stripe = verifier(SignatureScheme::Stripe, &["whsec_x"]);
    let standard = verifier(SignatureScheme::StandardWebhooks, &["whsec_eA"]);
    let cases: [(&WebhookVerifier, Vec<(&'static str, String)>); 7] = [
        (&stripe, vec![]),
        (&stripe, vec![("stripe-signature", "v1=00".into())]),
        (&stripe, vec![("stripe-signature", format!("t=1,t=2,v1={}", "00".repeat(32)))]),
        (&stripe, vec![("stripe-signature", "t=-5,v1=00".into())]),
        (&standard, vec![("webhook-timestamp", NOW.to_string()), ("webhook-signature", "v1,AAAA".into())]),
        (
            &standard,
            vec![
                ("webhook-id", "m".into()),
                ("webhook-timestamp", "soon".into()),
                ("webhook-signature", "v1,AAAA".into()),
            ],
        ),
        (
            &standard,
            vec![
                ("webhook-id", String::new()),
                ("webhook-timestamp", NOW.to_string()),
                ("webhook-signature", "v1,AAAA".into()),
            ],
        ),
    ];
    for (verifier, headers) in cases {
        let refused = verify(verifier, &headers, b"{}", NOW).expect_err("refused");
        assert!(
            matches!(refused, SignatureError::MissingHeader { .. } | SignatureError::MalformedHeader { .. }),
            "{headers:?}: {refused:?}"
        );
        assert!(!refused.is_unauthorized());
    }
}

/// A sender cannot make a delivery cost thousands of HMACs: more than 16 signatures is malformed. A
/// signed timestamp past what the clock can hold is stale, not a panic.
#[test]
fn many_signatures_or_a_timestamp_beyond_the_clock_are_refused() {
    let stripe = verifier(SignatureScheme::Stripe, &["whsec_x"]);
    let many = format!("t={NOW},{}", vec![format!("v1={}", "ab".repeat(32)); 17].join(","));
    let refused = verify(&stripe, &[("stripe-signature", many)], b"{}", NOW);
    assert!(matches!(refused, Err(SignatureError::MalformedHeader { .. })), "{refused:?}");
    let standard = verifier(SignatureScheme::StandardWebhooks, &["whsec_eA"]);
    let mut headers = standard.sign("m", at(NOW), b"{}");
    headers[2].1 = vec!["v1,AAAA"; 17].join(" ");
    assert!(matches!(verify(&standard, &headers, b"{}", NOW), Err(SignatureError::MalformedHeader { .. })));

    // Signed (with the secret) at the largest timestamp the headers can carry, past SystemTime's range.
    let huge = "9999999999999999999";
    let signed = hmac_sha256(b"whsec_x", &[huge.as_bytes(), b".", &body("evt_1")]);
    let hex: String = signed.iter().map(|b| format!("{b:02x}")).collect();
    let stripe_headers = [("stripe-signature", format!("t={huge},v1={hex}"))];
    let signed = hmac_sha256(b"x", &[b"evt_1.", huge.as_bytes(), b".", &body("evt_1")]);
    let standard_headers = [
        ("webhook-id", "evt_1".to_owned()),
        ("webhook-timestamp", huge.to_owned()),
        ("webhook-signature", format!("v1,{}", BASE64.encode(signed))),
    ];
    for (verifier, headers) in [(&stripe, &stripe_headers[..]), (&standard, &standard_headers[..])] {
        let answer = verify(verifier, headers, &body("evt_1"), NOW);
        assert!(matches!(answer, Err(SignatureError::Stale { .. })), "{:?}: {answer:?}", verifier.scheme());
    }
}

/// HMAC-SHA256 of the concatenated `parts`, computed here independently of the library.
fn hmac_sha256(key: &[u8], parts: &[&[u8]]) -> Vec<u8> {
    use hmac::{KeyInit as _, Mac as _};
    let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(key).expect("key");
    parts.iter().for_each(|part| mac.update(part));
    mac.finalize().into_bytes().to_vec()
}

/// Stripe's event id is the signed body's `id`; a body without one is refused, never handled under a
/// made-up id.
#[test]
fn a_stripe_body_without_an_id_is_refused() {
    let verifier = verifier(SignatureScheme::Stripe, &["whsec_x"]);
    for body in [&b"{}"[..], b"[]", b"not json", br#"{"id": 7}"#, br#"{"id": ""}"#] {
        let headers = verifier.sign("", at(NOW), body);
        let refused = verify(&verifier, &headers, body, NOW);
        assert!(matches!(refused, Err(SignatureError::MissingEventId)), "{refused:?}");
    }
}

#[test]
fn bad_secrets_are_refused_when_configured() {
    let none: [&str; 0] = [];
    for (scheme, secrets) in [
        (SignatureScheme::Stripe, &none[..]),
        (SignatureScheme::Stripe, &[""][..]),
        (SignatureScheme::StandardWebhooks, &["whsec_not base64!"][..]),
        (SignatureScheme::StandardWebhooks, &["whsec_"][..]),
    ] {
        let refused = WebhookVerifier::new(scheme, secrets.iter().copied());
        assert!(matches!(refused, Err(ConfigError::WebhookSecret { .. })), "{scheme:?} {secrets:?}");
    }
    let debug = format!("{:?}", verifier(SignatureScheme::Stripe, &["whsec_do_not_print"]));
    assert!(!debug.contains("do_not_print"), "{debug}");
}

/// Which signed part a case changes.
#[derive(Clone, Copy, Debug)]
enum Part {
    Body,
    EventId,
    Timestamp,
}

proptest! {
    /// Any one byte of the body or the event id (Standard Webhooks: the `webhook-id` header; Stripe: the
    /// body's `id`) changed after signing, or the timestamp moved by a few seconds (still within the
    /// tolerance, so only the signature can catch it): refused as a signature mismatch.
    #[test]
    fn any_changed_byte_of_body_id_or_timestamp_is_refused(
        standard in any::<bool>(),
        part in prop_oneof![Just(Part::Body), Just(Part::EventId), Just(Part::Timestamp)],
        position in any::<prop::sample::Index>(),
        flip in 1u8..=255,
        shift in 1u64..=99,
    ) {
        let scheme = if standard { SignatureScheme::StandardWebhooks } else { SignatureScheme::Stripe };
        let verifier = verifier(scheme, &["whsec_cHJvcGVydHktc2VjcmV0"]);
        let body = body("evt_1NqRproperty");
        let mut headers = verifier.sign("evt_1NqRproperty", at(NOW), &body);
        prop_assert!(verify(&verifier, &headers, &body, NOW).is_ok());
        let mut changed_body = body.clone();
        let moved = (NOW + shift).to_string();
        match (part, scheme) {
            (Part::Body, _) => changed_body[position.index(body.len())] ^= flip,
            (Part::EventId, SignatureScheme::Stripe) => {
                let start = body.windows(4).position(|w| w == b"evt_").expect("id");
                changed_body[start + position.index("evt_1NqRproperty".len())] ^= flip;
            }
            (Part::EventId, _) => {
                let mut id = headers[0].1.clone().into_bytes();
                let i = position.index(id.len());
                // Another visible ASCII byte, so the header stays a valid value.
                id[i] = b'!' + (id[i] - b'!' + (flip % 93).max(1)) % 94;
                headers[0].1 = String::from_utf8(id).expect("ASCII");
            }
            (Part::Timestamp, SignatureScheme::Stripe) => {
                let signature = headers[0].1.split_once(',').expect("t,v1").1.to_owned();
                headers[0].1 = format!("t={moved},{signature}");
            }
            (Part::Timestamp, _) => headers[1].1 = moved,
        }
        let answer = verify(&verifier, &headers, &changed_body, NOW);
        prop_assert!(matches!(answer, Err(SignatureError::Mismatch)), "{part:?} of {scheme:?} changed: {answer:?}");
    }
}
