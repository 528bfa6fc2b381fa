// A Go client of AgentService on stubs from `buf generate` (tests/test_other_languages.py
// builds and runs it): one streamed turn, then the ErrorInfo of a refused call.
package main

import (
	"context"
	"fmt"
	"io"
	"os"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/status"

	agentv1 "rollout-trace/gen/go/rollout/agent/v1"
)

func main() {
	conn, err := grpc.Dial(os.Args[1], grpc.WithInsecure())
	if err != nil {
		panic(err)
	}
	defer conn.Close()
	client := agentv1.NewAgentServiceClient(conn)
	ctx := context.Background()
	started, err := client.StartThread(ctx, &agentv1.StartThreadRequest{Instructions: "Be brief."})
	if err != nil {
		panic(err)
	}
	thread := started.GetThread()
	turn, err := client.StartTurn(ctx, &agentv1.StartTurnRequest{
		ThreadId: thread.GetId(),
		Input:    []*agentv1.UserInput{{Content: &agentv1.UserInput_Text{Text: "hello from Go"}}},
	})
	if err != nil {
		panic(err)
	}
	events, err := client.StreamEvents(ctx, &agentv1.StreamEventsRequest{ThreadId: thread.GetId()})
	if err != nil {
		panic(err)
	}
	for {
		response, err := events.Recv()
		if err == io.EOF {
			break
		}
		if err != nil {
			panic(err)
		}
		event := response.GetEvent()
		if delta := event.GetAgentMessageDelta(); delta != nil {
			fmt.Print(delta.GetDelta())
		}
		if done := event.GetTurnCompleted(); done != nil && event.GetTurnId() == turn.GetTurn().GetId() {
			fmt.Println("\n", done.GetTurn().GetStatus())
			break
		}
	}
	_, err = client.GetThread(ctx, &agentv1.GetThreadRequest{ThreadId: "nope"})
	for _, detail := range status.Convert(err).Details() {
		if info, ok := detail.(*errdetails.ErrorInfo); ok {
			fmt.Println(status.Code(err), info.GetReason(), info.GetMetadata())
		}
	}
}
