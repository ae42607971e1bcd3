//! The body of the layer's own answers (replays, refusals, and owner responses settled as they
//! stream), and how a whole one is made: below every module that answers.

use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http::{HeaderMap, Response};
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, BodyStream, Either, Full, StreamBody};
use tower::BoxError;

/// The boxed body of the layer's own answers.
pub type UnsyncBoxBody = http_body_util::combinators::UnsyncBoxBody<Bytes, BoxError>;

/// The name the layer's modules use for it.
pub(crate) type Boxed = UnsyncBoxBody;

/// A response whose body is the layer's own.
pub(crate) fn own<B>(response: Response<Boxed>) -> Response<Either<B, Boxed>> {
    response.map(Either::Right)
}

pub(crate) fn full(bytes: impl Into<Bytes>) -> Boxed {
    Full::new(bytes.into()).map_err(|never| match never {}).boxed_unsync()
}

/// A whole body, then its trailers if it has any.
pub(crate) fn with_trailers(bytes: Bytes, trailers: Option<HeaderMap>) -> Boxed {
    match trailers {
        None => full(bytes),
        Some(trailers) => full(bytes).with_trailers(std::future::ready(Some(Ok(trailers)))).boxed_unsync(),
    }
}

/// A body read in part: the frames already read, then the rest of it, `left` bytes more when the body
/// said how many it has (so that a server still ends the response after its last byte, and sends it
/// with its `Content-Length`).
pub(crate) fn resumed(read: Vec<Frame<Bytes>>, rest: Boxed, left: Option<u64>) -> Boxed {
    let read_bytes: u64 = read.iter().map(|frame| frame.data_ref().map_or(0, |data| data.len() as u64)).sum();
    let read = futures_util::stream::iter(read.into_iter().map(Ok));
    let chained = StreamBody::new(futures_util::StreamExt::chain(read, BodyStream::new(rest)));
    match left {
        Some(left) => Measured { inner: chained.boxed_unsync(), left: read_bytes + left }.boxed_unsync(),
        None => chained.boxed_unsync(),
    }
}

/// A body of a known number of bytes, `left` of which it has still to send.
struct Measured {
    inner: Boxed,
    left: u64,
}

impl Body for Measured {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let frame = ready!(Pin::new(&mut self.inner).poll_frame(cx));
        if let Some(Ok(data)) = frame.as_ref().map(|frame| frame.as_ref().map(Frame::data_ref)) {
            self.left = self.left.saturating_sub(data.map_or(0, |data| data.len() as u64));
        }
        Poll::Ready(frame)
    }

    /// The inner body's word only: trailers may follow the last byte.
    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.left)
    }
}
