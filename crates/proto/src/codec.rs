//! The codec of every generated client and server: prost's, with smaller initial buffers.
//! A stream keeps its encode (or decode) buffer for as long as it lives, and a run's event stream
//! and each tool call's stream from a runner live as long as the run or the call (10,000 runs held
//! open kept 8 KiB per stream with tonic's default); 1 KiB holds a batch of text events or a call's
//! result frame, and the buffer grows for a larger message as before.

use std::marker::PhantomData;

use tonic::codec::{BufferSettings, Codec};
use tonic_prost::{ProstDecoder, ProstEncoder};

/// Initial size of an encode or decode buffer.
pub const BUFFER_BYTES: usize = 1024;
/// Bytes encoded before a stream yields to the runtime (tonic's default).
const YIELD_THRESHOLD: usize = 32 * 1024;

/// [`tonic_prost::ProstCodec`] with [`BUFFER_BYTES`] as its encoders' and decoders' initial buffer.
#[derive(Debug, Clone, Copy)]
pub struct LeanCodec<T, U>(PhantomData<(T, U)>);

impl<T, U> Default for LeanCodec<T, U> {
    fn default() -> Self {
        Self(PhantomData)
    }
}

impl<T, U> Codec for LeanCodec<T, U>
where
    T: prost::Message + Send + 'static,
    U: prost::Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = ProstDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstEncoder::new(BufferSettings::new(BUFFER_BYTES, YIELD_THRESHOLD))
    }

    fn decoder(&mut self) -> Self::Decoder {
        ProstDecoder::new(BufferSettings::new(BUFFER_BYTES, YIELD_THRESHOLD))
    }
}
