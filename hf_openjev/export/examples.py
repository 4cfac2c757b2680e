"""Example requests of every question kind: the demo answers them, export's probe scores them."""

DEMO_REQUESTS = [
    {
        "state": "Where is my package? I ordered it last week and it still hasn't arrived.",
        "questions": {
            "intent": {
                "type": "choice",
                "instructions": "Which intent does the user's message express?",
                "criteria": {"track_order": "Wants to know where an order is", "cancel_order": "Wants to cancel",
                             "billing_question": None},
            },
            "urgency": {"type": "score", "instructions": "How urgent is the message?",
                        "criteria": ["not urgent", "somewhat urgent", "very urgent"]},
            "late": {"type": "noul", "instructions": "Is the customer's order late?",
                     "criteria": {"true": "it should have arrived", "false": "it is on time"}},
        },
    },
    {
        "state": {"ticket": 4471, "messages": ["Das Paket kam beschädigt an.", "Bitte ersetzen."]},
        "questions": {"refund": {"type": "noul", "instructions": "Does the customer ask for a replacement?"}},
    },
]
