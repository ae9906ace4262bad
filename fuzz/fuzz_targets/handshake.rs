//! Fuzz one side of the link hand-shake fed arbitrary bytes, time and decisions (`clan_wire::fuzzing::handshake`).
//! Run: `cargo fuzz run handshake` (seed corpus: `fuzz/corpus/handshake`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| clan_wire::fuzzing::handshake(data));
