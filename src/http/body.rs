//! The owner's response body: the handler's frames go to the client as they come, a copy is kept up to
//! the capture limit, the lease is extended while the body streams, and the record is settled when the
//! body ends, before the client sees its end. A response larger than the limit is settled as completed
//! but not replayable, so a retry never runs the work again; a client that goes away mid-body does not
//! leave the record unsettled either, and neither does one that stops reading: past the layer's
//! streaming bound the record is settled as not replayable while the body goes on.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, StatusCode};
use http_body::{Frame, SizeHint};
use http_body_util::BodyExt;
use tokio_util::task::AbortOnDropHandle;
use tower::BoxError;

use super::boxed::{Boxed, resumed};
use super::capture::{self, Captured, Principal, Withheld};
use super::config::StoredStatuses;
use crate::store::Background;
use crate::store::{KeepAlive, Owner};

/// The owner, until one of three settles it: the body's end, the body's drop, or the streaming bound.
type SharedOwner = Arc<Mutex<Option<Owner>>>;

fn take(owner: &SharedOwner) -> Option<Owner> {
    owner.lock().unwrap_or_else(PoisonError::into_inner).take()
}

/// What an owner's response leaves in the store once its body ended.
pub(crate) struct Settlement {
    /// Taken by whichever settles first; still here if the settlement was dropped unmade.
    owner: SharedOwner,
    status: StatusCode,
    /// The response's headers that are replayed.
    headers: HeaderMap,
    /// The names of the header and trailer fields that are replayed.
    replayed: Vec<HeaderName>,
    /// The body's trailers, once it sent them.
    trailers: Option<HeaderMap>,
    /// Which responses are stored; the others release the key so a retry runs again.
    rule: StoredStatuses,
    /// Whether the status (and a gRPC status in the headers) is stored.
    stored: bool,
    limit: usize,
    body: Vec<u8>,
    /// Body bytes produced so far (read by the streaming bound too).
    sent: Arc<AtomicU64>,
    /// The handler's body failed (or panicked) before its end: what was sent is not a response to replay.
    broken: bool,
    /// Extends the lease while the body streams; dropped with the settlement.
    keep_alive: Option<KeepAlive>,
    /// Settles the record as not replayable once the body has streamed for the layer's bound (a client
    /// that stops reading would otherwise hold the key, its lease extended, for as long as it likes).
    bound: Option<AbortOnDropHandle<()>>,
    /// Who the response answers.
    principal: Principal,
}

impl Settlement {
    /// Starts extending the owner's lease until the settlement is made (or dropped).
    pub(crate) fn new(
        owner: Owner,
        status: StatusCode,
        headers: &HeaderMap,
        rule: StoredStatuses,
        (limit, replayed): (usize, &[HeaderName]),
        principal: Principal,
    ) -> Self {
        let stored = rule.stores(status) && rule.stores_grpc(headers);
        let (headers, replayed) = (capture::replayed(headers, replayed), replayed.to_vec());
        let keep_alive = Some(owner.keep_alive());
        let (owner, sent) = (Arc::new(Mutex::new(Some(owner))), Arc::new(AtomicU64::new(0)));
        let (trailers, body, broken, bound) = (None, Vec::new(), false, None);
        Self {
            owner,
            status,
            headers,
            replayed,
            trailers,
            rule,
            stored,
            limit,
            body,
            sent,
            broken,
            keep_alive,
            bound,
            principal,
        }
    }

    /// Arms the streaming bound: after `streaming`, a body that has not ended is settled as not replayable.
    fn bound_streaming(&mut self, streaming: Duration) {
        self.bound = Some(AbortOnDropHandle::new(tokio::spawn(self.bounded(streaming))));
    }

    /// Settles now as the streaming bound does ([`bound`]): the body is past it.
    async fn past_bound(self) {
        self.bounded(Duration::ZERO).await;
    }

    /// [`bound`] for this settlement, after `streaming`.
    fn bounded(&self, streaming: Duration) -> impl Future<Output = ()> + Send + 'static {
        let (owner, sent) = (Arc::clone(&self.owner), Arc::clone(&self.sent));
        bound(streaming, owner, sent, self.stored.then_some((self.status, self.principal)))
    }

    fn sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }

    /// Where a settlement that must outlive this one runs; `None` once settled.
    fn background(&self) -> Option<Background> {
        self.owner.lock().unwrap_or_else(PoisonError::into_inner).as_ref().map(Owner::background)
    }

    /// Keeps a copy of `data` while the body stays within the limit; past it, none (and frees the copy).
    fn record(&mut self, data: &Bytes) {
        self.sent.fetch_add(data.len() as u64, Ordering::Relaxed);
        if !self.stored || self.over_limit() {
            self.body = Vec::new();
        } else {
            self.body.extend_from_slice(data);
        }
    }

    /// Keeps what a frame adds to the stored response: its data, or the trailers.
    fn frame(&mut self, frame: &Frame<Bytes>) {
        if let Some(data) = frame.data_ref() {
            self.record(data);
        } else if let Some(trailers) = frame.trailers_ref() {
            self.trailers = Some(trailers.clone());
        }
    }

    fn over_limit(&self) -> bool {
        self.sent() > self.limit as u64
    }

    /// Whether the rest of the body can change the settlement: only a stored status within the limit
    /// still needs the rest (to store it).
    fn needs_the_rest(&self) -> bool {
        self.stored && !self.over_limit() && !self.broken
    }

    /// Stores the response (or that it was sent but cannot be replayed), or releases the key for a status
    /// that is not stored. A failure cannot change what the client got (the handler ran): it is logged,
    /// and the lease runs out under the record's rule.
    pub(crate) async fn settle(mut self) {
        if let Some(settling) = self.settling() {
            settling.await;
        }
    }

    /// The store call that settles, owning what it needs (so that `Drop` can hand it to a task); `None`
    /// once taken.
    fn settling(&mut self) -> Option<impl Future<Output = ()> + Send + 'static> {
        let owner = take(&self.owner)?;
        self.keep_alive = None;
        // A gRPC status in the trailers decides too (a stream that failed after its headers).
        let stored = self.stored && self.trailers.as_ref().is_none_or(|trailers| self.rule.stores_grpc(trailers));
        let stored = if !stored {
            None
        } else if self.over_limit() || self.broken {
            Some(Withheld::new(self.status, self.sent(), self.principal).encode())
        } else {
            let body = std::mem::take(&mut self.body);
            let trailers = self.trailers.as_ref().map(|trailers| capture::replayed(trailers, &self.replayed));
            let captured = Captured::new(self.status, &self.headers, body, trailers.as_ref(), self.principal);
            Some(captured.encode())
        };
        Some(settle_owner(owner, stored))
    }
}

/// Completes the record with `stored`, or releases the key. A failure cannot change what the client got
/// (the handler ran): it is logged, and the lease runs out under the record's rule.
async fn settle_owner(owner: Owner, stored: Option<Vec<u8>>) {
    let fence = owner.fence();
    let settled = match stored {
        Some(stored) => owner.complete(&stored).await,
        None => owner.release().await,
    };
    if let Err(error) = settled {
        tracing::warn!(%error, fence, "could not settle the idempotency record");
    }
}

/// After `streaming`, settles a record whose body has not ended: as a response sent but not stored (the
/// work ran, so a retry is told so and never runs it again). A status that is not stored is not
/// released (a retry would run the handler while the first body may still be producing): its lease is
/// no longer extended, and the record's rule decides when it runs out. The body goes on streaming to the
/// client; its end then finds the record settled.
async fn bound(
    streaming: Duration,
    owner: SharedOwner,
    sent: Arc<AtomicU64>,
    withheld: Option<(StatusCode, Principal)>,
) {
    tokio::time::sleep(streaming).await;
    // No await between taking the owner and handing it on: an abort here would drop it unsettled.
    let Some(owner) = take(&owner) else { return };
    let Some((status, principal)) = withheld else {
        tracing::warn!(?streaming, "the response streamed past the layer's bound; its key is left to its lease");
        return owner.abandon();
    };
    tracing::warn!(?streaming, "the response streamed past the layer's bound; its record is settled as not replayable");
    let stored = Withheld::new(status, sent.load(Ordering::Relaxed), principal).encode();
    owner.background().settle(settle_owner(owner, Some(stored)));
}

impl Drop for Settlement {
    /// Dropped unmade: the handler answered, and its response was cut short (the request was cancelled
    /// while the body was read). The work ran, so the record is settled as not replayable (or released,
    /// for a status that is not stored); never released for a retry to run it again. That takes I/O,
    /// which `Drop` cannot wait for, and nothing else runs after a dropped future: a task does it.
    fn drop(&mut self) {
        self.broken = true;
        if let (Some(background), Some(settling)) = (self.background(), self.settling()) {
            background.settle(settling);
        }
    }
}

/// What became of a body known to fit the capture limit ([`settle_whole`]).
pub(crate) enum Whole {
    /// Read to its end and settled: the body and its trailers, or `None` if it failed (the record then
    /// says the response cannot be replayed).
    Settled(Option<(Bytes, Option<HeaderMap>)>),
    /// Not whole within the layer's streaming bound (a handler that passed on an upstream's
    /// `Content-Length` while the upstream stalls): settled as a streamed body is past the bound (as not
    /// replayable, or left to its lease for a status that is not stored); the body goes on to the
    /// client, what was read first.
    Stalled(Boxed),
}

/// Settles with the whole of a body known to fit the capture limit (or empty), before the client gets
/// anything: the record is stored by the time the client sees the status. Within `streaming`, as a body
/// that streams is:
/// before, a known length that never came held the key in flight for good, its lease extended.
pub(crate) async fn settle_whole<B>(mut settlement: Settlement, body: B, streaming: Duration) -> Whole
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let length = http_body::Body::size_hint(&body).exact();
    let mut body = body.map_err(Into::into).boxed_unsync();
    let (mut frames, mut seen) = (Vec::new(), 0u64);
    let reading = async {
        // To its end, not its declared length: trailers may follow the last byte.
        while let Some(frame) = body.frame().await {
            let frame = frame?;
            seen += frame.data_ref().map_or(0, |data| data.len() as u64);
            frames.push(frame);
        }
        Ok::<_, BoxError>(())
    };
    let read = match tokio::time::timeout(streaming, reading).await {
        Ok(read) => read,
        Err(_) => {
            settlement.sent.fetch_add(seen, Ordering::Relaxed);
            settlement.past_bound().await;
            return Whole::Stalled(resumed(frames, body, length.map(|length| length.saturating_sub(seen))));
        }
    };
    let collected = read.ok().map(|()| {
        let mut bytes = Vec::new();
        for frame in frames {
            match frame.into_data() {
                Ok(data) => bytes.extend_from_slice(&data),
                Err(frame) => settlement.trailers = frame.into_trailers().ok(),
            }
        }
        Bytes::from(bytes)
    });
    match &collected {
        Some(bytes) => settlement.record(bytes),
        None => settlement.broken = true,
    }
    let trailers = settlement.trailers.clone();
    settlement.settle().await;
    Whole::Settled(collected.map(|bytes| (bytes, trailers)))
}

/// Whether a body is small enough to be settled whole before the response starts: empty, or of a known
/// length within the capture limit.
pub(crate) fn fits(body: &impl http_body::Body, limit: usize) -> bool {
    http_body::Body::is_end_stream(body) || http_body::Body::size_hint(body).exact().is_some_and(|n| n <= limit as u64)
}

type Settling = Pin<Box<dyn Future<Output = ()> + Send>>;

/// The body handed to the client in place of the handler's.
pub(crate) struct SettlingBody {
    inner: Option<Boxed>,
    /// The handler body's exact length, when it said so: reaching it is its end (a server that sent
    /// `Content-Length` stops polling after the last byte, so the end would never be seen otherwise).
    expected: Option<u64>,
    settlement: Option<Settlement>,
    settling: Option<Settling>,
    /// Where the settlement runs if the body is dropped before its end (a shutdown waits for it).
    background: Option<Background>,
    /// The last frame, held back until the record is settled.
    last: Option<Frame<Bytes>>,
    /// The handler body's error, returned once the record is settled.
    failed: Option<BoxError>,
}

impl SettlingBody {
    /// The body of `settlement`'s response, settled when it ends or after `streaming`, whichever is first.
    pub(crate) fn new<B>(inner: B, mut settlement: Settlement, streaming: Duration) -> Self
    where
        B: http_body::Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        let expected = http_body::Body::size_hint(&inner).exact();
        let inner = inner.map_err(Into::into).boxed_unsync();
        let (settling, last, failed) = (None, None, None);
        let background = settlement.background();
        settlement.bound_streaming(streaming);
        Self { inner: Some(inner), expected, settlement: Some(settlement), settling, background, last, failed }
    }

    /// The handler's body ended (or failed): settle before the client gets the end.
    fn end(&mut self) {
        self.inner = None;
        if let Some(settlement) = self.settlement.take() {
            self.settling = Some(Box::pin(settlement.settle()));
        }
    }

    fn at_end(&self, inner: &Boxed) -> bool {
        http_body::Body::is_end_stream(inner)
            || self.settlement.as_ref().is_some_and(|s| self.expected.is_some_and(|length| s.sent() >= length))
    }
}

impl http_body::Body for SettlingBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        loop {
            if let Some(settling) = &mut this.settling {
                ready!(settling.as_mut().poll(cx));
                this.settling = None;
                if let Some(error) = this.failed.take() {
                    return Poll::Ready(Some(Err(error)));
                }
                return Poll::Ready(this.last.take().map(Ok));
            }
            let Some(inner) = &mut this.inner else { return Poll::Ready(None) };
            match ready!(Pin::new(inner).poll_frame(cx)) {
                Some(Ok(frame)) => {
                    if let Some(settlement) = &mut this.settlement {
                        settlement.frame(&frame);
                    }
                    if this.inner.as_ref().is_some_and(|inner| this.at_end(inner)) {
                        this.last = Some(frame);
                        this.end();
                        continue;
                    }
                    return Poll::Ready(Some(Ok(frame)));
                }
                Some(Err(error)) => {
                    if let Some(settlement) = &mut this.settlement {
                        settlement.broken = true;
                    }
                    this.failed = Some(error);
                    this.end();
                }
                None => this.end(),
            }
        }
    }

    /// Never "ended" before the record is settled and the last frame handed over.
    fn is_end_stream(&self) -> bool {
        self.inner.is_none() && self.settling.is_none() && self.last.is_none() && self.failed.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        match (&self.inner, &self.last) {
            (Some(inner), _) => http_body::Body::size_hint(inner),
            (None, Some(last)) => SizeHint::with_exact(last.data_ref().map_or(0, |data| data.len() as u64)),
            (None, None) => SizeHint::with_exact(0),
        }
    }
}

impl Drop for SettlingBody {
    /// The body was dropped before its end: the client went away, or the server gave up on it. The work
    /// ran, so the record must still be settled; that takes I/O, which `Drop` cannot wait for, and nothing
    /// else runs after a dropped body. So a task settles it (or finishes a settlement under way). If the
    /// rest of the body can still change what is stored, the task first drains it, within the capture
    /// limit and one lease: an endless stream (server-sent events) is then settled as not replayable.
    fn drop(&mut self) {
        let Some(background) = self.background.take() else { return };
        if let Some(settling) = self.settling.take() {
            background.settle(settling);
            return;
        }
        let Some(settlement) = self.settlement.take().filter(|s| s.background().is_some()) else { return };
        let inner = self.inner.take().filter(|_| settlement.needs_the_rest());
        background.settle(drain_and_settle(inner, settlement));
    }
}

/// Drains what is left of the handler's body into `settlement` (bounded: the capture limit and one
/// lease; a panicking body counts as broken), then settles.
async fn drain_and_settle(inner: Option<Boxed>, mut settlement: Settlement) {
    if let Some(mut inner) = inner {
        let lease = settlement
            .owner
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .map_or(Duration::ZERO, |owner| owner.policy().lease());
        let (limit, deadline) = (settlement.limit as u64, lease);
        // Its own task, so that a body that panics fails that task, not the settlement.
        let mut drained = tokio::spawn(async move {
            let mut frames = Vec::new();
            let mut size = 0u64;
            while let Some(frame) = inner.frame().await {
                let frame = frame.map_err(|_| ())?;
                size += frame.data_ref().map_or(0, |data| data.len() as u64);
                frames.push(frame);
                if size > limit {
                    break;
                }
            }
            Ok::<_, ()>(frames)
        });
        match tokio::time::timeout(deadline, &mut drained).await {
            Ok(Ok(Ok(frames))) => frames.iter().for_each(|frame| settlement.frame(frame)),
            // Failed, panicked, or endless (stopped here): what the client got cannot be replayed.
            _ => {
                drained.abort();
                settlement.broken = true;
            }
        }
    }
    settlement.settle().await;
}
