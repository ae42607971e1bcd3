//! The body of the layer's own answers (replays, refusals, and owner responses settled as they
//! stream), and how a whole one is made: below every module that answers.

use bytes::Bytes;
use http::{HeaderMap, Response};
use http_body_util::{BodyExt, Either, Full};
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

/// A body read in part: the frames already read, then the rest of it.
pub(crate) fn resumed(read: Vec<http_body::Frame<Bytes>>, rest: Boxed) -> Boxed {
    let read = futures_util::stream::iter(read.into_iter().map(Ok));
    let rest = http_body_util::BodyStream::new(rest);
    http_body_util::StreamBody::new(futures_util::StreamExt::chain(read, rest)).boxed_unsync()
}
