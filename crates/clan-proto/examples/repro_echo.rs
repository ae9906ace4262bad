use clan::{EndpointAddr, Nic, NicConfig};
use clan_proto::stream::{Listener, Stream, StreamConfig};
use std::io::{Read, Write};
use std::time::{Duration, Instant};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    match args[1].as_str() {
        "server" => {
            let nic = Nic::open(NicConfig { port: 40111, ..NicConfig::default() }).unwrap();
            let l = Listener::bind_with(&nic, Some(7), StreamConfig::default()).unwrap();
            println!("ready {}", l.local_addr());
            loop {
                match l.accept() {
                    Ok((s, _)) => {
                        std::thread::spawn(move || {
                            let mut b = [0u8; 1];
                            if (&s).read_exact(&mut b).is_ok() {
                                let _ = (&s).write_all(&b);
                            }
                            let _ = (&s).read(&mut b);
                        });
                    }
                    Err(e) => {
                        eprintln!("accept error: {e} kind {:?}", e.kind());
                    }
                }
            }
        }
        "client" => {
            let n: usize = args[2].parse().unwrap();
            let addr: EndpointAddr = args[3].parse().unwrap();
            let nic = Nic::open(NicConfig::default()).unwrap();
            let mut fails = 0;
            for _ in 0..n {
                let t = Instant::now();
                let cfg = StreamConfig { connect_timeout: Duration::from_secs(5), ..Default::default() };
                match Stream::connect_with(&nic, addr, &cfg) {
                    Ok(mut s) => {
                        s.write_all(b"x").unwrap();
                        let mut b = [0u8; 1];
                        s.read_exact(&mut b).unwrap();
                    }
                    Err(e) => {
                        fails += 1;
                        eprintln!("connect failed after {:?}: {e} {:?}", t.elapsed(), e.kind());
                    }
                }
            }
            println!("fails {fails}");
        }
        _ => {}
    }
}
