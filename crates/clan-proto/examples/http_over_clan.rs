//! An unmodified protocol crate over clan: an HTTP/1 server and client (hyper) talking over
//! a clan stream instead of TCP.
//!
//! ```sh
//! cargo run -p clan-proto --features tokio --example http_over_clan          # shared memory
//! cargo run -p clan-proto --features tokio --example http_over_clan -- link  # over a TCP link
//! ```

use std::convert::Infallible;

use clan::{LocalTransport, Nic, NicConfig};
use clan_proto::stream::StreamConfig;
use clan_proto::tokio::{AsyncListener, Reactor};
use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;

/// Serve HTTP on `listener` forever: `GET /hello` says hello, `POST /echo` echoes the body,
/// anything else is a 404.
pub async fn serve(listener: AsyncListener) {
    loop {
        let Ok((stream, _peer)) = listener.accept().await else { return };
        tokio::spawn(async move {
            let svc = service_fn(|req: Request<Incoming>| async move {
                let path = req.uri().path().to_owned();
                let method = req.method().clone();
                let body = req.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
                let resp = match (method.as_str(), path.as_str()) {
                    ("GET", "/hello") => Response::new(Full::new(Bytes::from_static(b"hello over clan"))),
                    ("POST", "/echo") => Response::new(Full::new(body)),
                    _ => {
                        let mut r = Response::new(Full::new(Bytes::from_static(b"not found")));
                        *r.status_mut() = hyper::StatusCode::NOT_FOUND;
                        r
                    }
                };
                Ok::<_, Infallible>(resp)
            });
            let _ = hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), svc).await;
        });
    }
}

/// Send requests over one clan stream; returns (status, body) per request.
pub async fn requests(
    reactor: &Reactor,
    addr: clan::EndpointAddr,
    reqs: Vec<(&'static str, &'static str, Vec<u8>)>,
) -> Result<Vec<(u16, Vec<u8>)>, Box<dyn std::error::Error + Send + Sync>> {
    let stream = reactor.connect(addr, StreamConfig::default()).await?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let mut out = Vec::new();
    for (method, path, body) in reqs {
        let req =
            Request::builder().method(method).uri(path).header("host", "clan").body(Full::new(Bytes::from(body)))?;
        // HTTP/1 sends one request at a time: the connection task may still be finishing the
        // previous exchange when its response body has been read, so wait until it is ready
        // (hyper's contract for reusing a `SendRequest`).
        sender.ready().await?;
        let resp = sender.send_request(req).await?;
        let status = resp.status().as_u16();
        let body = resp.into_body().collect().await?.to_bytes().to_vec();
        out.push((status, body));
    }
    Ok(out)
}

#[allow(dead_code)]
#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let link = std::env::args().nth(1).as_deref() == Some("link");
    let cfg = || NicConfig {
        local_transport: if link { LocalTransport::Link } else { LocalTransport::SharedMemory },
        ..NicConfig::default()
    };
    let (server_nic, client_nic) = (Nic::open(cfg())?, Nic::open(cfg())?);
    let server = Reactor::new(&server_nic)?;
    let listener = server.bind(StreamConfig::default())?;
    let addr = listener.local_addr();
    tokio::spawn(serve(listener));
    let client = Reactor::new(&client_nic)?;
    let answers = requests(
        &client,
        addr,
        vec![("GET", "/hello", Vec::new()), ("POST", "/echo", b"ping".to_vec()), ("GET", "/nope", Vec::new())],
    )
    .await?;
    for (status, body) in answers {
        println!("{status} {}", String::from_utf8_lossy(&body));
    }
    Ok(())
}
