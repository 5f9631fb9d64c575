// pionturn: a minimal pion/turn v2 server (STUNner's dataplane is pion/turn) for
// perf/compare.sh: static credentials, loopback relay, N SO_REUSEPORT listener sockets, and a
// TURN-TCP listener on the same address (as STUNner's TURN-TCP listeners).
package main

import (
	"context"
	"flag"
	"log"
	"net"
	"os"
	"os/signal"
	"syscall"

	"github.com/pion/turn/v2"
)

func main() {
	listen := flag.String("listen", "127.0.0.1:3478", "UDP listen address")
	user := flag.String("user", "user1", "username")
	pass := flag.String("pass", "pass1", "password")
	realm := flag.String("realm", "pion", "realm")
	threads := flag.Int("threads", 1, "SO_REUSEPORT listener sockets")
	flag.Parse()

	key := turn.GenerateAuthKey(*user, *realm, *pass)
	config := net.ListenConfig{Control: func(network, address string, c syscall.RawConn) error {
		var err error
		c.Control(func(fd uintptr) {
			err = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, 0xf /* SO_REUSEPORT */, 1)
		})
		return err
	}}
	var conns []turn.PacketConnConfig
	for i := 0; i < *threads; i++ {
		conn, err := config.ListenPacket(context.Background(), "udp4", *listen)
		if err != nil {
			log.Fatalf("listen: %v", err)
		}
		conns = append(conns, turn.PacketConnConfig{
			PacketConn: conn,
			RelayAddressGenerator: &turn.RelayAddressGeneratorStatic{
				RelayAddress: net.ParseIP("127.0.0.1"),
				Address:      "127.0.0.1",
			},
		})
	}
	tcp, err := net.Listen("tcp4", *listen)
	if err != nil {
		log.Fatalf("listen tcp: %v", err)
	}
	server, err := turn.NewServer(turn.ServerConfig{
		Realm: *realm,
		AuthHandler: func(username, realm string, src net.Addr) ([]byte, bool) {
			return key, username == *user
		},
		PacketConnConfigs: conns,
		ListenerConfigs: []turn.ListenerConfig{{
			Listener: tcp,
			RelayAddressGenerator: &turn.RelayAddressGeneratorStatic{
				RelayAddress: net.ParseIP("127.0.0.1"),
				Address:      "127.0.0.1",
			},
		}},
	})
	if err != nil {
		log.Fatalf("server: %v", err)
	}
	log.Printf("pionturn listening on %s with %d socket(s)", *listen, *threads)
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM)
	<-sig
	_ = server.Close()
}
