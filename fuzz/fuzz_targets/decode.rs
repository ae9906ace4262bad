//! Fuzz the streaming decoder: arbitrary bytes, fed in arbitrary chunks, sometimes with the
//! payload moved by the caller; and the link state's acknowledgement checks on what decodes.
//! Run: `cargo fuzz run decode` (seed corpus: `fuzz/corpus/decode`, real frames).
#![no_main]

use clan_wire::{Decoder, Frame, Item, LinkConfig, LinkState};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&chunking, bytes)) = data.split_first() else { return };
    let step = usize::from(chunking % 64) + 1;
    let direct = chunking & 0x80 != 0;
    let mut dec = Decoder::new();
    let mut link = LinkState::new(LinkConfig::default(), std::time::Instant::now());
    let mut buf: Vec<u8> = Vec::new();
    let mut pos = 0;
    loop {
        if pos < bytes.len() {
            let n = step.min(bytes.len() - pos);
            buf.extend_from_slice(&bytes[pos..pos + n]);
            pos += n;
        } else if buf.is_empty() {
            break;
        }
        loop {
            if direct {
                if let Some(p) = dec.pending_payload() {
                    let rem = match p {
                        clan_wire::Pending::Write { remaining, .. } => remaining,
                        clan_wire::Pending::ReadResp { remaining, .. } => remaining,
                    };
                    let n = (rem as usize).min(buf.len());
                    if n > 0 {
                        assert!(dec.consume_payload(n as u64).is_ok());
                        buf.drain(..n);
                        continue;
                    }
                }
            }
            match dec.next(&buf) {
                Ok(Some((item, used))) => {
                    assert!(used <= buf.len());
                    match item {
                        Item::Frame(Frame::Ack(a)) => {
                            let _ = link.on_ack(a);
                        }
                        Item::Frame(Frame::Credit { bytes }) => link.on_credit(bytes),
                        Item::WriteBegin { len, .. } => { let _ = len; link.on_write_applied(true, 0) },
                        Item::WriteData { data, .. } => link.on_write_applied(false, data.len() as u64),
                        _ => {}
                    }
                    buf.drain(..used);
                }
                Ok(None) => break,
                Err(_) => return,
            }
        }
        if pos >= bytes.len() {
            // No more input: anything left is an incomplete frame.
            break;
        }
    }
});
