//! The codec of every generated client and server: prost's, with a smaller initial encode buffer.
//! A response stream keeps its encode buffer for as long as it lives, and a run's event stream
//! lives as long as the run (10,000 runs held open kept 8 KiB each with tonic's default); 1 KiB
//! holds a batch of text events, and the buffer grows for a larger message as before.

use std::marker::PhantomData;

use tonic::codec::{BufferSettings, Codec};
use tonic_prost::{ProstDecoder, ProstEncoder};

/// Initial size of an encode buffer.
pub const ENCODE_BUFFER_BYTES: usize = 1024;
/// Bytes encoded before a stream yields to the runtime (tonic's default).
const YIELD_THRESHOLD: usize = 32 * 1024;

/// [`tonic_prost::ProstCodec`] with [`ENCODE_BUFFER_BYTES`] as its encoders' initial buffer.
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
        ProstEncoder::new(BufferSettings::new(ENCODE_BUFFER_BYTES, YIELD_THRESHOLD))
    }

    fn decoder(&mut self) -> Self::Decoder {
        ProstDecoder::new(BufferSettings::default())
    }
}
