//! Signed webhook deliveries: a delivery is handled only if its provider signed it, recently.
//!
//! Without a signature, anyone who can reach the endpoint can send a made-up delivery with a real
//! event's id before the provider does; the inbox would then acknowledge the real delivery as a
//! duplicate for as long as the record is kept. So the event id is taken from the signed material
//! only, the signature is compared in constant time against every active secret (several while a
//! secret is rotated), and a delivery whose signed timestamp is too far from now is refused, so a
//! captured delivery cannot be replayed once its record has been purged.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use hmac::{Hmac, KeyInit as _, Mac as _};
use sha2::Sha256;
use zeroize::Zeroizing;

use crate::error::{ConfigError, SignatureError};

/// Signatures read from one delivery at most (providers send one per active secret); a header with more
/// is malformed, so that a sender cannot make every request cost thousands of HMACs.
const MAX_SIGNATURES: usize = 16;

/// How far a delivery's signed timestamp may be from now, by default (both providers' libraries use 5
/// minutes).
pub const DEFAULT_TOLERANCE: Duration = Duration::from_secs(300);
/// The longest tolerance a verifier takes ([`WebhookVerifier::tolerance`]).
pub const MAX_TOLERANCE: Duration = Duration::from_secs(3600);

/// The two signature schemes in wide use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum SignatureScheme {
    /// Stripe's `Stripe-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256 of "t.body">` (several `v1`
    /// while Stripe rolls a secret). The secret (`whsec_...`) is the HMAC key as written; the event id
    /// is the body's `id`.
    Stripe,
    /// [Standard Webhooks](https://www.standardwebhooks.com/) (Svix and the providers built on it):
    /// `webhook-id`, `webhook-timestamp` and `webhook-signature: v1,<base64 HMAC-SHA256 of
    /// "id.timestamp.body">` (space-separated, several while a secret is rotated). The secret is
    /// `whsec_` and the base64 of the key; the event id is `webhook-id`.
    StandardWebhooks,
}

/// What a verified delivery says, from its signed material only.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct VerifiedDelivery {
    /// The event id, to pass to [`Inbox::receive`](crate::Inbox::receive).
    pub event_id: String,
    /// When the provider signed the delivery.
    pub signed_at: SystemTime,
    /// The verifier that checked it ([`WebhookVerifier`]'s identity, shared by its clones).
    pub(crate) verifier: u64,
}

/// The event a delivery is received as ([`Inbox::receive`](crate::Inbox::receive)): a
/// [`VerifiedDelivery`], or a bare event id (a queue message's id, which no signature vouches for). An
/// inbox with a verifier ([`Inbox::verified_by`](crate::Inbox::verified_by)) takes only deliveries
/// that its own verifier checked.
#[derive(Clone, Copy, Debug)]
pub struct EventId<'a> {
    pub(crate) id: &'a str,
    pub(crate) verifier: Option<u64>,
}

impl<'a> From<&'a VerifiedDelivery> for EventId<'a> {
    fn from(delivery: &'a VerifiedDelivery) -> Self {
        Self { id: &delivery.event_id, verifier: Some(delivery.verifier) }
    }
}

impl<'a> From<&'a str> for EventId<'a> {
    fn from(id: &'a str) -> Self {
        Self { id, verifier: None }
    }
}

impl<'a> From<&'a String> for EventId<'a> {
    fn from(id: &'a String) -> Self {
        Self { id, verifier: None }
    }
}

/// Identities of verifiers, one per [`WebhookVerifier::new`].
static VERIFIERS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// A delivery's headers, looked up by name, ignoring case.
pub trait DeliveryHeaders {
    /// The value of the header `name` (lower case), if present and text.
    fn header(&self, name: &str) -> Option<&str>;
}

#[cfg(feature = "http")]
impl DeliveryHeaders for http::HeaderMap {
    fn header(&self, name: &str) -> Option<&str> {
        self.get(name).and_then(|value| value.to_str().ok())
    }
}

/// Name-value pairs, for deliveries that did not come over HTTP (a queue message's attributes).
impl DeliveryHeaders for [(&str, &str)] {
    fn header(&self, name: &str) -> Option<&str> {
        self.iter().find(|(candidate, _)| candidate.eq_ignore_ascii_case(name)).map(|(_, value)| *value)
    }
}

/// Checks one provider's signatures: its scheme, its active secrets and the timestamp tolerance.
///
/// ```
/// use idemstore::{SignatureScheme, WebhookVerifier};
///
/// let verifier = WebhookVerifier::new(SignatureScheme::Stripe, ["whsec_new", "whsec_old"])?;
/// let body = br#"{"id": "evt_1", "type": "charge.succeeded"}"#;
/// let headers = verifier.sign("evt_1", std::time::SystemTime::now(), body);
/// let headers: Vec<(&str, &str)> = headers.iter().map(|(name, value)| (*name, value.as_str())).collect();
/// let delivery = verifier.verify(headers.as_slice(), body)?;
/// assert_eq!(delivery.event_id, "evt_1");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct WebhookVerifier {
    scheme: SignatureScheme,
    /// HMAC keys, newest first.
    keys: Vec<Zeroizing<Vec<u8>>>,
    tolerance: Duration,
    /// Which verifier this is: its deliveries are received only by inboxes that hold it (or a clone).
    pub(crate) id: u64,
}

impl std::fmt::Debug for WebhookVerifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WebhookVerifier")
            .field("scheme", &self.scheme)
            .field("secrets", &self.keys.len())
            .field("tolerance", &self.tolerance)
            .finish()
    }
}

impl WebhookVerifier {
    /// A verifier of `scheme` that accepts a signature made with any of `secrets` (newest first; [`sign`]
    /// uses the first).
    ///
    /// # Errors
    /// [`ConfigError::WebhookSecret`] without a secret, for an empty one, or for a Standard Webhooks
    /// secret that is not `whsec_` and base64.
    ///
    /// [`sign`]: WebhookVerifier::sign
    pub fn new<S: AsRef<str>>(
        scheme: SignatureScheme,
        secrets: impl IntoIterator<Item = S>,
    ) -> Result<Self, ConfigError> {
        let keys = secrets
            .into_iter()
            .map(|secret| key_of(scheme, secret.as_ref()).map(Zeroizing::new))
            .collect::<Result<Vec<_>, _>>()?;
        if keys.is_empty() {
            return Err(ConfigError::WebhookSecret { reason: "no secret given" });
        }
        let id = VERIFIERS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(Self { scheme, keys, tolerance: DEFAULT_TOLERANCE, id })
    }

    /// How far a delivery's signed timestamp may be from now, either way (default 5 minutes; at most
    /// [`MAX_TOLERANCE`], one hour: a longer `tolerance` is that). The tolerance is how long a captured
    /// delivery can be replayed, so it stays short.
    pub fn tolerance(mut self, tolerance: Duration) -> Self {
        self.tolerance = tolerance.min(MAX_TOLERANCE);
        self
    }

    /// The scheme this verifier checks.
    pub fn scheme(&self) -> SignatureScheme {
        self.scheme
    }

    /// Verifies a delivery now; see [`WebhookVerifier::verify_at`].
    ///
    /// # Errors
    /// As [`WebhookVerifier::verify_at`].
    pub fn verify<H: DeliveryHeaders + ?Sized>(
        &self,
        headers: &H,
        body: &[u8],
    ) -> Result<VerifiedDelivery, SignatureError> {
        self.verify_at(headers, body, SystemTime::now())
    }

    /// Verifies a delivery as of `now`: its signature matches one of the secrets, over exactly this body
    /// and timestamp (and, for Standard Webhooks, this event id), and the timestamp is within the
    /// tolerance of `now`.
    ///
    /// # Errors
    /// [`SignatureError::MissingHeader`] or [`SignatureError::MalformedHeader`] for an unsigned or
    /// garbled delivery, [`SignatureError::Mismatch`] if no signature matches, [`SignatureError::Stale`]
    /// for a timestamp out of tolerance, [`SignatureError::MissingEventId`] for a Stripe body without
    /// an `id`.
    pub fn verify_at<H: DeliveryHeaders + ?Sized>(
        &self,
        headers: &H,
        body: &[u8],
        now: SystemTime,
    ) -> Result<VerifiedDelivery, SignatureError> {
        let signed = Signed::read(self.scheme, headers)?;
        let matches = self.keys.iter().any(|key| {
            let mac = self.mac(key, signed.event_id, signed.timestamp, body);
            // Every candidate is checked in constant time; which one matched is not observable.
            signed.signatures.iter().any(|signature| mac.clone().verify_slice(signature).is_ok())
        });
        if !matches {
            return Err(SignatureError::Mismatch);
        }
        let Some(signed_at) = UNIX_EPOCH.checked_add(Duration::from_secs(signed.timestamp)) else {
            return Err(SignatureError::Stale { skew: Duration::MAX, tolerance: self.tolerance });
        };
        let skew = now.duration_since(signed_at).unwrap_or_else(|early| early.duration());
        if skew > self.tolerance {
            return Err(SignatureError::Stale { skew, tolerance: self.tolerance });
        }
        let event_id = match signed.event_id {
            Some(id) => id.to_owned(),
            None => event_id_of(body)?,
        };
        Ok(VerifiedDelivery { event_id, signed_at, verifier: self.id })
    }

    /// The headers that sign `body` as event `event_id` at `at` with the newest secret: what the
    /// provider would send. For tests, and for services that send webhooks of their own. (Stripe's
    /// scheme takes the event id from the body, so `event_id` must be the body's `id`.)
    pub fn sign(&self, event_id: &str, at: SystemTime, body: &[u8]) -> Vec<(&'static str, String)> {
        let timestamp = at.duration_since(UNIX_EPOCH).map_or(0, |since| since.as_secs());
        let id = (self.scheme == SignatureScheme::StandardWebhooks).then_some(event_id);
        let tag = self.mac(&self.keys[0], id, timestamp, body).finalize().into_bytes();
        match self.scheme {
            SignatureScheme::Stripe => {
                let mut hex = [0; 64];
                crate::fingerprint::write_hex(&tag, &mut hex);
                let hex = std::str::from_utf8(&hex).expect("hex digits are ASCII");
                vec![("stripe-signature", format!("t={timestamp},v1={hex}"))]
            }
            SignatureScheme::StandardWebhooks => vec![
                ("webhook-id", event_id.to_owned()),
                ("webhook-timestamp", timestamp.to_string()),
                ("webhook-signature", format!("v1,{}", BASE64.encode(tag))),
            ],
        }
    }

    /// The HMAC of the signed material: `id.timestamp.body` or, without an id (Stripe), `timestamp.body`.
    fn mac(&self, key: &[u8], event_id: Option<&str>, timestamp: u64, body: &[u8]) -> Hmac<Sha256> {
        let mut mac = Hmac::<Sha256>::new_from_slice(key).expect("HMAC takes a key of any length");
        if let Some(id) = event_id {
            mac.update(id.as_bytes());
            mac.update(b".");
        }
        mac.update(timestamp.to_string().as_bytes());
        mac.update(b".");
        mac.update(body);
        mac
    }
}

/// Secrets are copied by hand from dashboards: with or without base64's `=` padding.
const SECRET_BASE64: base64::engine::GeneralPurpose = base64::engine::GeneralPurpose::new(
    &base64::alphabet::STANDARD,
    base64::engine::GeneralPurposeConfig::new()
        .with_decode_padding_mode(base64::engine::DecodePaddingMode::Indifferent),
);

/// The HMAC key of a secret as the scheme writes it.
fn key_of(scheme: SignatureScheme, secret: &str) -> Result<Vec<u8>, ConfigError> {
    let key = match scheme {
        SignatureScheme::Stripe => secret.as_bytes().to_vec(),
        SignatureScheme::StandardWebhooks => SECRET_BASE64
            .decode(secret.strip_prefix("whsec_").unwrap_or(secret))
            .map_err(|_| ConfigError::WebhookSecret { reason: "a Standard Webhooks secret is whsec_ and base64" })?,
    };
    if key.is_empty() {
        return Err(ConfigError::WebhookSecret { reason: "a secret is empty" });
    }
    Ok(key)
}

/// The signed parts of a delivery's headers.
struct Signed<'h> {
    event_id: Option<&'h str>,
    timestamp: u64,
    signatures: Vec<Vec<u8>>,
}

impl<'h> Signed<'h> {
    fn read<H: DeliveryHeaders + ?Sized>(scheme: SignatureScheme, headers: &'h H) -> Result<Self, SignatureError> {
        let required = |name: &'static str| headers.header(name).ok_or(SignatureError::MissingHeader { name });
        let malformed = |name: &'static str| SignatureError::MalformedHeader { name };
        match scheme {
            SignatureScheme::Stripe => {
                const NAME: &str = "stripe-signature";
                let (mut timestamp, mut signatures) = (None, Vec::new());
                for item in required(NAME)?.split(',') {
                    match item.trim().split_once('=') {
                        Some(("t", t)) if timestamp.is_none() => timestamp = Some(seconds(t).ok_or(malformed(NAME))?),
                        Some(("t", _)) => return Err(malformed(NAME)),
                        // A v1 that is not 32 bytes of hex cannot match; it is skipped like other schemes.
                        Some(("v1", hex)) => signatures.extend(from_hex(hex)),
                        Some(_) => {}
                        None => return Err(malformed(NAME)),
                    }
                }
                let timestamp = timestamp.ok_or(malformed(NAME))?;
                if signatures.len() > MAX_SIGNATURES {
                    return Err(malformed(NAME));
                }
                Ok(Self { event_id: None, timestamp, signatures })
            }
            SignatureScheme::StandardWebhooks => {
                let event_id = required("webhook-id")?;
                if event_id.is_empty() {
                    return Err(malformed("webhook-id"));
                }
                let timestamp = seconds(required("webhook-timestamp")?).ok_or(malformed("webhook-timestamp"))?;
                let entries = required("webhook-signature")?.split_ascii_whitespace();
                if entries.clone().count() > MAX_SIGNATURES {
                    return Err(malformed("webhook-signature"));
                }
                let signatures = entries
                    .filter_map(|entry| entry.strip_prefix("v1,"))
                    .filter_map(|encoded| BASE64.decode(encoded).ok())
                    .collect();
                Ok(Self { event_id: Some(event_id), timestamp, signatures })
            }
        }
    }
}

/// Unix seconds as both schemes write them: decimal digits only.
fn seconds(text: &str) -> Option<u64> {
    (!text.is_empty() && text.len() <= 19 && text.bytes().all(|b| b.is_ascii_digit())).then(|| text.parse().ok())?
}

/// 32 bytes from 64 hex digits.
fn from_hex(text: &str) -> Option<Vec<u8>> {
    if text.len() != 64 {
        return None;
    }
    let digit = |c: u8| char::from(c).to_digit(16).map(|d| d as u8);
    text.as_bytes().chunks_exact(2).map(|pair| Some(digit(pair[0])? << 4 | digit(pair[1])?)).collect()
}

/// The top-level `id` of a JSON body (Stripe's event id).
fn event_id_of(body: &[u8]) -> Result<String, SignatureError> {
    #[derive(serde::Deserialize)]
    struct Event {
        id: String,
    }
    match serde_json::from_slice::<Event>(body) {
        Ok(Event { id }) if !id.is_empty() => Ok(id),
        _ => Err(SignatureError::MissingEventId),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tolerance past the bound is the bound: a delivery captured two hours ago is stale, whatever the
    /// verifier was asked (before: `Duration::MAX` accepted a captured delivery for ever).
    #[test]
    fn the_tolerance_is_bounded() {
        let verifier = WebhookVerifier::new(SignatureScheme::Stripe, ["whsec_test_secret"]).unwrap();
        let verifier = verifier.tolerance(Duration::MAX);
        let signed_at = UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        let signed = verifier.sign("evt_1", signed_at, b"{\"id\":\"evt_1\"}");
        let headers: Vec<(&str, &str)> = signed.iter().map(|(name, value)| (*name, value.as_str())).collect();
        let later = signed_at + Duration::from_secs(2 * 3600);
        let verified = verifier.verify_at(&headers[..], b"{\"id\":\"evt_1\"}", later);
        assert!(matches!(verified, Err(SignatureError::Stale { .. })), "{verified:?}");
        assert!(verifier.verify_at(&headers[..], b"{\"id\":\"evt_1\"}", signed_at + MAX_TOLERANCE / 2).is_ok());
    }

    /// Stripe's method, computed independently: HMAC-SHA256 over `t.body` with the whole `whsec_` string
    /// as the key, in lower-case hex.
    #[test]
    fn a_stripe_signature_is_hex_hmac_of_timestamp_dot_body() {
        let verifier = WebhookVerifier::new(SignatureScheme::Stripe, ["whsec_test_secret"]).unwrap();
        let headers = verifier.sign("evt_1", UNIX_EPOCH + Duration::from_secs(1_492_774_577), b"{\"id\":\"evt_1\"}");
        let mut mac = Hmac::<Sha256>::new_from_slice(b"whsec_test_secret").unwrap();
        mac.update(b"1492774577.{\"id\":\"evt_1\"}");
        let mut hex = [0; 64];
        crate::fingerprint::write_hex(&mac.finalize().into_bytes(), &mut hex);
        let expected = format!("t=1492774577,v1={}", std::str::from_utf8(&hex).unwrap());
        assert_eq!(headers, vec![("stripe-signature", expected)]);
    }

    /// The Standard Webhooks specification's test vector.
    #[test]
    fn the_standard_webhooks_test_vector_verifies() {
        let verifier =
            WebhookVerifier::new(SignatureScheme::StandardWebhooks, ["whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"])
                .unwrap();
        let body = br#"{"test": 2432232314}"#;
        let headers: [(&str, &str); 3] = [
            ("webhook-id", "msg_p5jXN8AQM9LWM0D4loKWxJek"),
            ("webhook-timestamp", "1614265330"),
            ("webhook-signature", "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="),
        ];
        let at = UNIX_EPOCH + Duration::from_secs(1_614_265_330);
        let delivery = verifier.verify_at(headers.as_slice(), body, at).expect("the specification's vector");
        assert_eq!(delivery.event_id, "msg_p5jXN8AQM9LWM0D4loKWxJek");
        let signed = verifier.sign("msg_p5jXN8AQM9LWM0D4loKWxJek", at, body);
        assert_eq!(signed[2].1, "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=");
    }

    #[test]
    fn hex_and_seconds_parse_strictly() {
        assert_eq!(from_hex(&"0f".repeat(32)), Some(vec![15; 32]));
        assert_eq!(from_hex(&"0g".repeat(32)), None);
        assert_eq!(from_hex("0f"), None);
        assert_eq!(seconds("1614265330"), Some(1_614_265_330));
        for bad in ["", "-1", "+1", "1.5", " 1", "99999999999999999999"] {
            assert_eq!(seconds(bad), None, "{bad:?}");
        }
    }
}
