//! Stored responses encrypted at rest, in both tiers.
//!
//! An idempotency store keeps a copy of every answer an API gave (card fingerprints, addresses, tokens)
//! in two more places than the application's own data, often for days. With [`Encryption`] configured,
//! a response is sealed once, before either tier sees it, and both tiers hold the same ciphertext: a
//! database dump, a Redis RDB file or a `MONITOR` session reveals sizes and timing, not content.
//!
//! - **A key per tenant**: HKDF-SHA256 of the master key with the tenant as info, so a tenant's records
//!   never share a key with another tenant's.
//! - **Bound to its record and its request**: the operation, the idempotency key and the request's
//!   fingerprint are the associated data, so a ciphertext copied onto another record, or a record whose
//!   fingerprint was changed beside it (by someone who can write a tier), does not open: a sealed response
//!   opens only beside the fingerprint it was sealed with.
//! - **XChaCha20-Poly1305 with a random 192-bit nonce**: no nonce bookkeeping, safe for any number of
//!   records per key.
//! - **Rotation**: each sealed response starts with the id of the master key that sealed it (derived from
//!   the key itself). New responses use the newest key; older ones open while their key is still
//!   configured; a response whose key is gone, or whose bytes were changed, is an [`EncryptionError`],
//!   never a wrong replay.
//!
//! Layout: `0xE5 0x1D | key id (4) | nonce (24) | ciphertext | tag (16)`, 46 bytes more than the
//! response. The two first bytes never start UTF-8 text (0x1D is no continuation byte) nor JSON nor the
//! HTTP layer's stored form, so a store without encryption tells a sealed response from one in clear.
//! Fingerprints and keys stay as they are: they are digests, and Postgres needs them to arbitrate.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use base64::Engine as _;
use chacha20poly1305::aead::AeadInOut as _;
use chacha20poly1305::{KeyInit as _, XChaCha20Poly1305, XNonce};
use hkdf::Hkdf;
use sha2::Sha256;
use zeroize::Zeroizing;

use crate::error::{ConfigError, EncryptionError};
use crate::key::{IdempotencyKey, Scope};

/// The first bytes of a sealed response (a format version).
pub(crate) const SEALED: [u8; 2] = [0xE5, 0x1D];
const KEY_ID: usize = 4;
const NONCE: usize = 24;
const TAG: usize = 16;
const HEADER: usize = SEALED.len() + KEY_ID + NONCE;

/// The bytes a sealed response adds to the response: header and tag.
pub const SEALING_OVERHEAD: usize = HEADER + TAG;

/// The master keys that seal stored responses, newest first ([`StoreBuilder::encryption`]).
///
/// ```
/// use idemstore::Encryption;
///
/// // 32 random bytes each, from a secret manager; base64 in the environment.
/// let current = [7u8; 32];
/// let previous = [9u8; 32];
/// let encryption = Encryption::new([current, previous])?;
/// assert_eq!(encryption.key_ids().len(), 2);
/// // The same, as `IDEMSTORE_ENCRYPTION_KEY` holds it: base64, newest first, comma-separated.
/// # use base64::Engine as _;
/// # let b64 = |k: &[u8]| base64::engine::general_purpose::STANDARD.encode(k);
/// let from_env = Encryption::from_base64(&format!("{},{}", b64(&current), b64(&previous)))?;
/// assert_eq!(from_env.key_ids(), encryption.key_ids());
/// # Ok::<(), idemstore::ConfigError>(())
/// ```
///
/// [`StoreBuilder::encryption`]: crate::StoreBuilder::encryption
#[derive(Clone)]
pub struct Encryption {
    /// Newest first.
    keys: Vec<Arc<MasterKey>>,
    accept_unsealed: bool,
}

/// One master key: its id, its HKDF pseudorandom key, and the ciphers of the tenants it served (a
/// replay then costs one cipher pass, not a key derivation).
struct MasterKey {
    id: u32,
    prk: Zeroizing<[u8; 32]>,
    tenants: RwLock<HashMap<String, XChaCha20Poly1305>>,
}

/// Tenants whose ciphers a master key keeps; past this, the cache starts over.
const CACHED_TENANTS: usize = 10_000;

impl MasterKey {
    fn new(master: &[u8; 32]) -> Self {
        let (prk, _) = Hkdf::<Sha256>::extract(Some(b"idemstore response v1"), master);
        let mut kept = Zeroizing::new([0; 32]);
        kept.copy_from_slice(&prk);
        Self { id: key_id(master), prk: kept, tenants: RwLock::default() }
    }

    /// The tenant's cipher: its key is HKDF-SHA256(master, tenant).
    fn cipher(&self, tenant: &str) -> XChaCha20Poly1305 {
        if let Some(cipher) = self.tenants.read().unwrap_or_else(|poisoned| poisoned.into_inner()).get(tenant) {
            return cipher.clone();
        }
        let mut key = Zeroizing::new([0; 32]);
        Hkdf::<Sha256>::from_prk(self.prk.as_ref())
            .expect("a 32-byte pseudorandom key")
            .expand(tenant.as_bytes(), key.as_mut())
            .expect("32 bytes is a valid length");
        let cipher = XChaCha20Poly1305::new(&(*key).into());
        let mut tenants = self.tenants.write().unwrap_or_else(|poisoned| poisoned.into_inner());
        if tenants.len() >= CACHED_TENANTS {
            tenants.clear();
        }
        tenants.insert(tenant.to_owned(), cipher.clone());
        cipher
    }
}

impl std::fmt::Debug for Encryption {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Encryption")
            .field("key_ids", &self.key_ids())
            .field("accept_unsealed", &self.accept_unsealed)
            .finish()
    }
}

impl Encryption {
    /// Seals with the first key; opens what any of them sealed.
    ///
    /// # Errors
    /// [`ConfigError::EncryptionKey`] without a key, or with two keys that are the same.
    pub fn new(master_keys: impl IntoIterator<Item = [u8; 32]>) -> Result<Self, ConfigError> {
        let keys: Vec<_> = master_keys.into_iter().map(|key| Arc::new(MasterKey::new(&Zeroizing::new(key)))).collect();
        if keys.is_empty() {
            return Err(ConfigError::EncryptionKey { reason: "no key given" });
        }
        if keys.iter().enumerate().any(|(i, key)| keys[..i].iter().any(|other| other.id == key.id)) {
            return Err(ConfigError::EncryptionKey { reason: "a key is given twice" });
        }
        Ok(Self { keys, accept_unsealed: false })
    }

    /// Keys as an environment variable holds them: base64 of 32 bytes each, newest first, separated by
    /// commas (`IDEMSTORE_ENCRYPTION_KEY`).
    ///
    /// # Errors
    /// [`ConfigError::EncryptionKey`] for an entry that is not base64 of exactly 32 bytes; as
    /// [`Encryption::new`].
    pub fn from_base64(keys: &str) -> Result<Self, ConfigError> {
        let decode = |entry: &str| {
            let bytes = Zeroizing::new(
                base64::engine::general_purpose::STANDARD
                    .decode(entry.trim())
                    .map_err(|_| ConfigError::EncryptionKey { reason: "a key is not base64" })?,
            );
            <[u8; 32]>::try_from(bytes.as_slice())
                .map(Zeroizing::new)
                .map_err(|_| ConfigError::EncryptionKey { reason: "a key is not 32 bytes" })
        };
        let keys = keys.split(',').map(decode).collect::<Result<Vec<_>, _>>()?;
        Self::new(keys.iter().map(|key| **key))
    }

    /// Also replays responses stored before encryption was turned on (in clear), for the retention of
    /// the records of that time. Off by default: then a response in clear is refused, so nobody who can
    /// write to Redis or Postgres can plant a response to be replayed.
    ///
    /// A response is taken as sealed when it starts with the format byte (`0xE5`) and is long enough to
    /// be one: a response in clear of that shape (some binary encodings) is refused as
    /// [`EncryptionError::Tampered`], and with this option a sealed response cut shorter than its header
    /// and tag would be taken as clear. Use it for the transition only.
    pub fn accept_unsealed(mut self) -> Self {
        self.accept_unsealed = true;
        self
    }

    /// The ids of the keys, newest first, as sealed responses name them (and `idemctl inspect` shows).
    pub fn key_ids(&self) -> Vec<u32> {
        self.keys.iter().map(|key| key.id).collect()
    }

    /// The response as both tiers store it, for the request whose stored fingerprint is `fingerprint`.
    pub(crate) fn seal(&self, scope: &Scope, key: &IdempotencyKey, fingerprint: &[u8], response: &[u8]) -> Vec<u8> {
        let master = &self.keys[0];
        let nonce: [u8; NONCE] = rand::random();
        let mut sealed = Vec::with_capacity(SEALING_OVERHEAD + response.len());
        sealed.extend_from_slice(&SEALED);
        sealed.extend_from_slice(&master.id.to_be_bytes());
        sealed.extend_from_slice(&nonce);
        sealed.extend_from_slice(response);
        let associated = associated(scope, key, fingerprint);
        let tag = master
            .cipher(scope.tenant())
            .encrypt_inout_detached(&XNonce::from(nonce), &associated, (&mut sealed[HEADER..]).into())
            .expect("a response fits XChaCha20-Poly1305's length limit");
        sealed.extend_from_slice(&tag);
        sealed
    }

    /// The response a record stores, opened, for the request whose stored fingerprint is `fingerprint`.
    pub(crate) fn open<'a>(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        fingerprint: &[u8],
        stored: &'a [u8],
    ) -> Result<Cow<'a, [u8]>, EncryptionError> {
        let Some(id) = sealed_key_id(stored) else {
            return if self.accept_unsealed { Ok(Cow::Borrowed(stored)) } else { Err(EncryptionError::Unsealed) };
        };
        let master = self.keys.iter().find(|master| master.id == id).ok_or(EncryptionError::UnknownKey { id })?;
        let nonce = XNonce::try_from(&stored[SEALED.len() + KEY_ID..HEADER]).expect("24 bytes");
        let (ciphertext, tag) = stored[HEADER..].split_at(stored.len() - HEADER - TAG);
        let mut plain = ciphertext.to_vec();
        master
            .cipher(scope.tenant())
            .decrypt_inout_detached(
                &nonce,
                &associated(scope, key, fingerprint),
                plain.as_mut_slice().into(),
                tag.try_into().expect("16 bytes"),
            )
            .map_err(|_| EncryptionError::Tampered)?;
        Ok(Cow::Owned(plain))
    }
}

/// The key id of a response in the sealed form; `None` for one in clear. A store without encryption asks
/// this so that it never hands sealed bytes out as a response (UTF-8 text, JSON and the HTTP layer's
/// stored form never
/// start with the sealed form's first bytes).
pub(crate) fn sealed_key_id(stored: &[u8]) -> Option<u32> {
    let id = stored.get(SEALED.len()..SEALED.len() + KEY_ID)?;
    (stored.len() >= SEALING_OVERHEAD && stored.starts_with(&SEALED))
        .then(|| u32::from_be_bytes(id.try_into().expect("4 bytes")))
}

/// The id a sealed response names its master key by: the first 4 bytes of an HKDF output, so it says
/// nothing about the key, and no operator has to number keys.
fn key_id(master: &[u8; 32]) -> u32 {
    let mut id = [0; KEY_ID];
    Hkdf::<Sha256>::new(Some(b"idemstore key id"), master).expand(b"", &mut id).expect("4 bytes is a valid length");
    u32::from_be_bytes(id)
}

/// The record and request a ciphertext belongs to, length-prefixed: operation, fingerprint, key (the
/// tenant chose the cipher's key).
fn associated(scope: &Scope, key: &IdempotencyKey, fingerprint: &[u8]) -> Vec<u8> {
    let (operation, key) = (scope.operation().as_bytes(), key.as_str().as_bytes());
    let mut associated = Vec::with_capacity(8 + operation.len() + fingerprint.len() + key.len());
    for part in [operation, fingerprint] {
        associated.extend_from_slice(&(part.len() as u32).to_be_bytes());
        associated.extend_from_slice(part);
    }
    associated.extend_from_slice(key);
    associated
}

#[cfg(test)]
mod tests {
    use super::*;

    const FP: &[u8] = &[7; 32];

    fn record(tenant: &str, operation: &str, key: &str) -> (Scope, IdempotencyKey) {
        (Scope::new(tenant, operation).unwrap(), IdempotencyKey::new(key).unwrap())
    }

    #[test]
    fn a_sealed_response_opens_only_on_its_own_record() {
        let encryption = Encryption::new([[1; 32]]).unwrap();
        let (scope, key) = record("acme", "charge", "k1");
        let sealed = encryption.seal(&scope, &key, FP, b"{\"card\":\"4242\"}");
        assert_eq!(sealed.len(), 15 + SEALING_OVERHEAD);
        assert!(!sealed.windows(4).any(|w| w == b"4242"));
        assert_eq!(encryption.open(&scope, &key, FP, &sealed).unwrap().as_ref(), b"{\"card\":\"4242\"}");
        for (tenant, operation, other) in
            [("umbrella", "charge", "k1"), ("acme", "refund", "k1"), ("acme", "charge", "k2")]
        {
            let (scope, key) = record(tenant, operation, other);
            assert!(matches!(encryption.open(&scope, &key, FP, &sealed), Err(EncryptionError::Tampered)));
        }
    }

    #[test]
    fn every_changed_byte_is_refused() {
        let encryption = Encryption::new([[1; 32]]).unwrap();
        let (scope, key) = record("acme", "charge", "k1");
        let sealed = encryption.seal(&scope, &key, FP, b"response");
        for i in 0..sealed.len() {
            let mut changed = sealed.clone();
            changed[i] ^= 0x01;
            assert!(encryption.open(&scope, &key, FP, &changed).is_err(), "byte {i}");
        }
    }

    #[test]
    fn old_keys_open_until_removed_and_clear_text_only_when_accepted() {
        let (scope, key) = record("acme", "charge", "k1");
        let old = Encryption::new([[1; 32]]).unwrap();
        let sealed_before = old.seal(&scope, &key, FP, b"before");
        let rotated = Encryption::new([[2; 32], [1; 32]]).unwrap();
        assert_eq!(rotated.open(&scope, &key, FP, &sealed_before).unwrap().as_ref(), b"before");
        assert_eq!(rotated.seal(&scope, &key, FP, b"after")[2..6], key_id(&[2; 32]).to_be_bytes());
        let retired = Encryption::new([[2; 32]]).unwrap();
        let id = key_id(&[1; 32]);
        assert!(
            matches!(retired.open(&scope, &key, FP, &sealed_before), Err(EncryptionError::UnknownKey { id: i }) if i == id)
        );
        assert!(matches!(retired.open(&scope, &key, FP, b"clear"), Err(EncryptionError::Unsealed)));
        assert_eq!(retired.accept_unsealed().open(&scope, &key, FP, b"clear").unwrap().as_ref(), b"clear");
    }

    #[test]
    fn bad_keys_are_refused() {
        assert!(Encryption::new([]).is_err());
        assert!(Encryption::new([[1; 32], [1; 32]]).is_err());
        for text in ["", "not base64!", "AAAA", "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA,"] {
            assert!(Encryption::from_base64(text).is_err(), "{text:?}");
        }
        assert!(!format!("{:?}", Encryption::new([[0xAB; 32]]).unwrap()).contains("171"));
    }
}
