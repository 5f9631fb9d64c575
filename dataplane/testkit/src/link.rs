//! A TURN client over any of the four transports, one request at a time, built on turncat's
//! transports and the request signing of `uturn_perf::client`.

use std::net::SocketAddr;
use std::time::Duration;
use stun_proto::types::attribute::ErrorCode;
use stun_proto::types::message::{Message, MessageClass};

/// A TURN client over any of the four transports (turncat's [`Connector`]: UDP, TCP, TLS,
/// DTLS), driven one request at a time: what a peer-policy test needs to reach every entry
/// point (CreatePermission, ChannelBind, Send, ChannelData) and to see what is relayed back.
///
/// [`Connector`]: uturn_perf::turncat::transport::Connector
pub struct TurnLink {
    sender: std::sync::Arc<uturn_perf::turncat::transport::Sender>,
    receiver: uturn_perf::turncat::transport::Receiver,
    stream: bool,
    realm: String,
    nonce: String,
    /// Relayed data received, in order: (peer, payload); the peer is `None` for ChannelData.
    pub data: Vec<(Option<SocketAddr>, Vec<u8>)>,
    /// ChannelData received: (channel, payload).
    pub channel_data: Vec<(u16, Vec<u8>)>,
}

/// The username and password every [`TurnLink`] uses.
pub const LINK_CREDS: (&str, &str) = ("user1", "pass1");

impl TurnLink {
    /// Connects to `server` over `protocol` (any certificate accepted for TLS and DTLS).
    pub fn connect(
        protocol: uturn_perf::turncat::transport::Protocol,
        server: SocketAddr,
    ) -> std::io::Result<TurnLink> {
        use uturn_perf::turncat::secure::{dtls_connector, tls_config, Trust};
        use uturn_perf::turncat::transport::{Connector, Protocol, Security};
        let trust = Trust {
            insecure: true,
            ca_file: None,
        };
        let security = match protocol {
            Protocol::Udp | Protocol::Tcp => Security::Plain,
            Protocol::Tls => Security::Tls(tls_config(&trust).map_err(std::io::Error::other)?),
            Protocol::Dtls => Security::Dtls {
                connector: dtls_connector(&trust).map_err(std::io::Error::other)?,
                verify: false,
            },
        };
        let connector = Connector {
            protocol,
            server,
            server_name: server.ip().to_string(),
            security,
        };
        let (sender, receiver) = connector.connect()?;
        Ok(TurnLink {
            sender,
            receiver,
            stream: protocol.is_stream(),
            realm: String::new(),
            nonce: String::new(),
            data: Vec::new(),
            channel_data: Vec::new(),
        })
    }

    /// Sends one frame (ChannelData is padded here over streams).
    pub fn send_frame(&self, frame: &[u8]) {
        let mut frame = frame.to_vec();
        if self.stream && frame.first().is_some_and(|b| b & 0xc0 == 0x40) {
            frame.resize(frame.len().div_ceil(4) * 4, 0);
        }
        self.sender.send(&frame).expect("send to the server");
    }

    /// Reads for up to `secs`, keeping relayed data; the first STUN response for `txid`.
    fn read(&mut self, secs: f64, txid: Option<[u8; 12]>) -> Option<Vec<u8>> {
        use turn_types::attribute::{Data, XorPeerAddress};
        let deadline = std::time::Instant::now() + Duration::from_secs_f64(secs);
        while std::time::Instant::now() < deadline {
            if !self.receiver.recv().unwrap_or(false) {
                continue;
            }
            while let Ok(Some(frame)) = self.receiver.next_frame() {
                if frame.len() >= 4 && frame[0] & 0xc0 == 0x40 {
                    let channel = u16::from_be_bytes([frame[0], frame[1]]);
                    let len = usize::from(u16::from_be_bytes([frame[2], frame[3]]));
                    let payload = frame[4..(4 + len).min(frame.len())].to_vec();
                    self.channel_data.push((channel, payload.clone()));
                    self.data.push((None, payload));
                    continue;
                }
                let Ok(msg) = Message::from_bytes(frame) else {
                    continue;
                };
                if msg.has_class(MessageClass::Indication) {
                    let peer = msg
                        .attribute::<XorPeerAddress>()
                        .ok()
                        .map(|a| a.addr(msg.transaction_id()));
                    if let Ok(data) = msg.attribute::<Data>() {
                        self.data.push((peer, data.data().to_vec()));
                    }
                    continue;
                }
                if txid.is_some_and(|t| frame[8..20] == t) {
                    return Some(frame.to_vec());
                }
            }
        }
        None
    }

    /// Sends `method` with `attrs` (signed once a 401 taught the realm and nonce) and waits up
    /// to 5 s for its response: `Ok(response)` on success, `Err(code)` on an error (0: none).
    pub fn request(
        &mut self,
        method: stun_proto::types::message::Method,
        attrs: &dyn Fn(
            &mut stun_proto::types::message::MessageWriteVec,
            stun_proto::types::message::TransactionId,
        ),
    ) -> Result<Vec<u8>, u16> {
        use stun_proto::types::attribute::{Nonce, Realm};
        for _ in 0..3 {
            let creds = uturn_perf::client::Credentials {
                user: LINK_CREDS.0,
                pass: LINK_CREDS.1,
                realm: &self.realm,
                nonce: &self.nonce,
            };
            let signed = (!self.realm.is_empty()).then_some(&creds);
            let request = uturn_perf::client::build_request(method, attrs, signed).unwrap();
            let txid: [u8; 12] = request[8..20].try_into().unwrap();
            // Over UDP and DTLS a lost request is sent again (every 500 ms, for 5 s).
            let (tries, wait) = if self.stream { (1, 5.0) } else { (10, 0.5) };
            let mut reply = None;
            for _ in 0..tries {
                self.sender.send(&request).expect("send to the server");
                reply = self.read(wait, Some(txid));
                if reply.is_some() {
                    break;
                }
            }
            let reply = reply.ok_or(0u16)?;
            let msg = Message::from_bytes(&reply).map_err(|_| 0u16)?;
            if msg.has_class(MessageClass::Success) {
                return Ok(reply);
            }
            let code = msg.attribute::<ErrorCode>().map_or(0, |e| e.code());
            if code == 401 || code == 438 {
                if let (Ok(realm), Ok(nonce)) = (msg.attribute::<Realm>(), msg.attribute::<Nonce>())
                {
                    self.realm = realm.realm().into();
                    self.nonce = nonce.nonce().into();
                    continue;
                }
            }
            return Err(code);
        }
        Err(401)
    }

    /// Allocates a UDP relay (IPv6 if `ipv6`, with DONT-FRAGMENT if `dont_fragment`); the
    /// relayed address.
    pub fn allocate(&mut self, ipv6: bool, dont_fragment: bool) -> Result<SocketAddr, u16> {
        use stun_proto::types::message::MessageWriteExt as _;
        use stun_proto::types::AddressFamily;
        use turn_types::attribute::{DontFragment, RequestedAddressFamily, XorRelayedAddress};
        let reply = self.request(turn_types::message::ALLOCATE, &|m, txid| {
            uturn_perf::client::udp_transport(m, txid);
            if ipv6 {
                m.add_attribute(&RequestedAddressFamily::new(AddressFamily::IPV6))
                    .unwrap();
            }
            if dont_fragment {
                m.add_attribute(&DontFragment::new()).unwrap();
            }
        })?;
        let msg = Message::from_bytes(&reply).unwrap();
        Ok(msg
            .attribute::<XorRelayedAddress>()
            .unwrap()
            .addr(msg.transaction_id()))
    }

    /// CreatePermission for `peer`'s IP: `Err(code)` when refused.
    pub fn create_permission(&mut self, peer: SocketAddr) -> Result<(), u16> {
        use stun_proto::types::message::MessageWriteExt as _;
        use turn_types::attribute::XorPeerAddress;
        self.request(turn_types::message::CREATE_PERMISSION, &|m, txid| {
            m.add_attribute(&XorPeerAddress::new(peer, txid)).unwrap();
        })
        .map(drop)
    }

    /// ChannelBind of `channel` to `peer`: `Err(code)` when refused.
    pub fn bind_channel(&mut self, channel: u16, peer: SocketAddr) -> Result<(), u16> {
        use stun_proto::types::message::MessageWriteExt as _;
        use turn_types::attribute::{ChannelNumber, XorPeerAddress};
        self.request(turn_types::message::CHANNEL_BIND, &|m, txid| {
            m.add_attribute(&ChannelNumber::new(channel)).unwrap();
            m.add_attribute(&XorPeerAddress::new(peer, txid)).unwrap();
        })
        .map(drop)
    }

    /// Sends `data` to `peer` in a Send indication.
    pub fn send_indication(&self, peer: SocketAddr, data: &[u8]) {
        let indication = crate::engine::send_indication_to(peer, data);
        self.sender.send(&indication).expect("send to the server");
    }

    /// Sends `data` as ChannelData on `channel`.
    pub fn send_channel_data(&self, channel: u16, data: &[u8]) {
        let mut frame = uturn_perf::client::channel_data_header(channel, data.len()).to_vec();
        frame.extend_from_slice(data);
        self.send_frame(&frame);
    }

    /// Reads for `secs`, keeping relayed data in [`TurnLink::data`].
    pub fn drain(&mut self, secs: f64) {
        self.read(secs, None);
    }
}

/// A STUN Binding request: what a relay would send a TURN listener to see whether it answers.
pub fn binding_request() -> Vec<u8> {
    use stun_proto::types::message::{
        MessageType, MessageWrite, MessageWriteVec, TransactionId, BINDING,
    };
    Message::builder(
        MessageType::from_class_method(MessageClass::Request, BINDING),
        TransactionId::generate(),
        MessageWriteVec::new(),
    )
    .finish()
}
