//! Where responses cross into and out of the tiers: sealed once before either tier stores them, opened
//! before a replay or a lookup hands them out (see [`crate::Encryption`]). Everything between (Redis
//! repair from Postgres, TTLs, purges) moves the stored bytes as they are.

use std::borrow::Cow;

use super::Store;
use crate::error::StoreError;
use crate::key::{IdempotencyKey, Scope};
use crate::record::{Begin, Lease, Record, StoredResponse};

impl Store {
    /// `response` as both tiers store it for this lease's record.
    pub(crate) fn sealed<'r>(&self, lease: &Lease, response: &'r [u8]) -> Cow<'r, [u8]> {
        self.sealed_for(&lease.scope, &lease.key, response)
    }

    pub(crate) fn sealed_for<'r>(&self, scope: &Scope, key: &IdempotencyKey, response: &'r [u8]) -> Cow<'r, [u8]> {
        match &self.inner.encryption {
            Some(encryption) => Cow::Owned(encryption.seal(scope, key, response)),
            None => Cow::Borrowed(response),
        }
    }

    /// A claim's answer with a completed record's response opened.
    pub(crate) fn opened_answer(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        answer: Begin,
    ) -> Result<Begin, StoreError> {
        match answer {
            Begin::Completed(stored) => Ok(Begin::Completed(self.opened(scope, key, stored)?)),
            other => Ok(other),
        }
    }

    /// A record with its response opened.
    pub(crate) fn opened_record(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        mut record: Record,
    ) -> Result<Record, StoreError> {
        if let Some(stored) = record.response.take() {
            record.response = Some(self.opened(scope, key, stored)?);
        }
        Ok(record)
    }

    fn opened(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        stored: StoredResponse,
    ) -> Result<StoredResponse, StoreError> {
        let Some(encryption) = &self.inner.encryption else {
            return Ok(stored);
        };
        match encryption.open(scope, key, stored.as_bytes()) {
            Ok(Cow::Borrowed(_)) => Ok(stored),
            Ok(Cow::Owned(plain)) => Ok(StoredResponse::new(plain)),
            Err(error) => {
                crate::telemetry::unreadable_response(scope.operation(), error.reason());
                Err(error.into())
            }
        }
    }
}
