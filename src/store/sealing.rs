//! Where responses cross into and out of the tiers: sealed once before either tier stores them, opened
//! before a replay or a lookup hands them out (see [`crate::Encryption`]). Everything between (Redis
//! repair from Postgres, TTLs, purges) moves the stored bytes as they are.

use std::borrow::Cow;

use super::Store;
use crate::error::EncryptionError;
use crate::fingerprint::Fingerprint;
use crate::key::{IdempotencyKey, Scope};
use crate::record::{Lease, Record, StoredResponse};

impl Store {
    /// `response` as both tiers store it for this lease's record (which stores its fingerprint).
    pub(crate) fn sealed<'r>(&self, lease: &Lease, response: &'r [u8]) -> Cow<'r, [u8]> {
        self.sealed_for(&lease.scope, &lease.key, lease.fingerprint.as_bytes(), response)
    }

    /// `response` as both tiers store it for the record of `scope` and `key` that stores `fingerprint`.
    pub(crate) fn sealed_for<'r>(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        fingerprint: &[u8],
        response: &'r [u8],
    ) -> Cow<'r, [u8]> {
        match &self.inner.encryption {
            Some(encryption) => Cow::Owned(encryption.seal(scope, key, fingerprint, response)),
            None => Cow::Borrowed(response),
        }
    }

    /// A record with its response opened.
    pub(crate) fn opened_record(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        mut record: Record,
    ) -> Result<Record, EncryptionError> {
        if let Some(stored) = record.response.take() {
            record.response = Some(self.opened(scope, key, &record.fingerprint, stored, true)?);
        }
        Ok(record)
    }

    /// A response Redis answered for `request`: it matched the request's fingerprint. Never one in
    /// clear, whatever [`crate::Encryption::accept_unsealed`] says: a copy in Redis may have been written
    /// by anyone who can write there, and Postgres answers instead.
    pub(crate) fn opened_for(
        &self,
        request: &Fingerprint,
        scope: &Scope,
        key: &IdempotencyKey,
        stored: StoredResponse,
    ) -> Result<StoredResponse, EncryptionError> {
        self.opened(scope, key, request.as_bytes(), stored, false)
    }

    /// The stored response of the record of `scope` and `key`, sealed beside `fingerprint`, opened; one
    /// in clear only if `clear_accepted` and the store accepts those.
    pub(crate) fn opened(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        fingerprint: &[u8],
        stored: StoredResponse,
        clear_accepted: bool,
    ) -> Result<StoredResponse, EncryptionError> {
        let Some(encryption) = &self.inner.encryption else {
            // Sealed by a store that has the key (encryption turned off here, a rollback, a second
            // service): ciphertext is never a response.
            return match crate::encryption::sealed_key_id(stored.as_bytes()) {
                Some(id) => Err(EncryptionError::UnknownKey { id }),
                None => Ok(stored),
            };
        };
        let opened = match encryption.open(scope, key, fingerprint, stored.as_bytes())? {
            Cow::Owned(plain) => Some(plain),
            Cow::Borrowed(_) if clear_accepted => None,
            Cow::Borrowed(_) => return Err(EncryptionError::Unsealed),
        };
        Ok(opened.map_or(stored, StoredResponse::new))
    }
}
