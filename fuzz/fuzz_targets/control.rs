//! Fuzz the host control channel: request and reply decoders (with their round trip) and a serving session fed arbitrary packets (`clan_wire::fuzzing::control`).
//! Run: `cargo fuzz run control` (seed corpus: `fuzz/corpus/control`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| clan_wire::fuzzing::control(data));
